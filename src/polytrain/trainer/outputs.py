"""Output paths: checked before any worker starts, written without ever replacing a user's file.

[Note: output paths] Every path a run writes (``checkpoint.save_final``, ``observe.trace``,
``checkpoint.dir``, ``observe.out_dir``) is checked in pre-flight (`check_output_paths`): a file
path must not exist yet and its directory must be a directory we can create a file in (probed
by creating and removing a temporary file: permission bits alone do not say, e.g. for root or
on read-only mounts); a directory path must be a directory or creatable under a writable one.
A run used to train for its whole length and then fail to write its weights.

A check in pre-flight cannot stop a file from appearing at the path during the run, so the
final weights are published with `publish_new`: written to a unique temporary file beside the
target (never ``<path>.tmp``, which may be the user's), then hard-linked to the target name,
which fails if the name exists. In that case the weights are linked to a sibling name instead
and `OutputError` names it: nothing is overwritten and nothing is lost.

`RunLock` keeps two concurrent runs out of one ``observe.out_dir``: an ``fcntl.flock`` on
``<out_dir>/.polytrain.lock`` (holding the owner's pid, for the message). The kernel drops the
lock when its process dies, so a lock file left by a dead run is simply taken over.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from polytrain.config.job import JobConfig
from polytrain.errors import ConfigError, OutputError

__all__ = ["LOCK_NAME", "RunLock", "check_output_paths", "publish_new"]

LOCK_NAME = ".polytrain.lock"


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _writable_dir(directory: Path, what: str) -> None:
    """`ConfigError` unless a file can be created under ``directory`` (or where it would go)."""
    existing = _nearest_existing(directory)
    if not existing.is_dir():
        raise ConfigError(
            f"{what}: {str(existing)!r} is a file, not a directory: choose a path under a directory"
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=".polytrain-probe-", dir=existing)
    except OSError as exc:
        raise ConfigError(
            f"{what}: cannot create files in {str(existing)!r} ({exc.strerror}): choose a "
            "writable location"
        ) from None
    os.close(fd)
    os.unlink(probe)


def _check_new_file(value: str, flag: str) -> None:
    path = Path(value)
    what = f"{flag} {value!r}"
    if path.exists() or path.is_symlink():
        kind = "a directory" if path.is_dir() else "a file"
        raise ConfigError(f"{what} already exists ({kind}): choose another path or remove it")
    _writable_dir(path.parent, what)


def _check_dir(value: str, flag: str) -> None:
    path = Path(value)
    what = f"{flag} {value!r}"
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what} is a file, not a directory: choose a directory path")
    _writable_dir(path, what)


def check_output_paths(job: JobConfig) -> None:
    """Pre-flight: every output path is of the right type and writable ([Note: output paths])."""
    if job.checkpoint.save_final:
        _check_new_file(job.checkpoint.save_final, "--save-final")
    if job.observe.trace:
        _check_new_file(job.observe.trace, "--trace")
    if job.checkpoint.dir:
        _check_dir(job.checkpoint.dir, "--checkpoint-dir")
    if job.observe.out_dir:
        _check_dir(job.observe.out_dir, "--out-dir")


def _umask() -> int:
    """This process's umask (reading it means setting it; it is put back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def publish_new(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Create ``path`` with ``write(tmp)``, never replacing an existing file; return the path
    written. If ``path`` appeared meanwhile, the data goes to a sibling name and `OutputError`
    names it ([Note: output paths])."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 is for the temporary name only
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        try:
            os.link(tmp, out)  # fails if the name exists: no overwrite, ever
            return out
        except FileExistsError:
            pass
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for n in range(1000):
            sibling = out.with_name(f"{out.stem}-{stamp}{f'-{n}' if n else ''}{out.suffix}")
            with contextlib.suppress(FileExistsError):
                os.link(tmp, sibling)
                raise OutputError(
                    f"{str(out)!r} was created by someone else during the run and was left "
                    f"alone: what the run wrote there is in {str(sibling)!r}"
                )
        raise OutputError(f"{str(out)!r} exists and no free sibling name was found")
    finally:
        tmp.unlink(missing_ok=True)


class RunLock:
    """An exclusive lock on a run directory for the life of a run ([Note: output paths])."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(
                f"--out-dir {str(self.path.parent)!r} is in use by another run (pid {holder}): "
                "choose another --out-dir, or wait for that run to end"
            ) from None
        try:
            current = os.stat(self.path).st_ino
        except FileNotFoundError:
            current = -1
        if current != os.fstat(fd).st_ino:  # released and unlinked while we opened it: retry
            os.close(fd)
            return self.acquire()
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            self.path.unlink(missing_ok=True)  # before unlocking: a waiter then makes a new one
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

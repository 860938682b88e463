"""Local device slots: each start is ``python3 -m polytrain train`` as a child process tree.

[Note: local children] A start runs ``/bin/sh -c '<trainer>; echo $? > start-<n>.exit'`` in a
new session (so its own process group, which ``stop`` signals as a whole: the shell, the
launcher and its elastic workers) with stdout and stderr appended to ``start-<n>.log``. Its
pid, with its start time from ``/proc``, goes to ``start-<n>.pid``. The exit status is written
to a file, not only collected by ``waitpid``, because a restarted scheduler is no longer the
parent of the jobs it adopts: it learns how they ended from that file. A GPU job sees only its
placed devices (``CUDA_VISIBLE_DEVICES``), so its local ranks 0..K-1 are those devices.

``stop`` sends SIGTERM to the group (the trainer stops its workers and exits), waits
``grace_s``, then SIGKILLs what is left. Linux only: liveness and pid reuse are read from
``/proc``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from polytrain.scheduler.backend import Launch

__all__ = ["LocalBackend", "group_alive", "trainer_command"]

# "$1" is the exit file; the rest is the trainer's command line (no quoting of our own).
_WRAPPER = 'f=$1; shift; "$@"; c=$?; echo "$c" > "$f.tmp" && mv "$f.tmp" "$f"'


def trainer_command(
    launch: Launch, device: Literal["cpu", "cuda"], python: str = sys.executable
) -> list[str]:
    """The ``polytrain train`` command line of one start (the scheduler's flags override the
    job file's ``launch.nproc``, ``train.device``, ``checkpoint.*`` and ``observe.out_dir``)."""
    cmd = [
        *(python, "-m", "polytrain", "train", "--config", str(launch.config)),
        *("--nproc", str(len(launch.devices)), "--device", device),
        *("--checkpoint-dir", str(launch.checkpoint_dir)),
        *("--checkpoint-every", str(launch.checkpoint_every)),
        *("--out-dir", str(launch.run_dir), "--no-progress"),
    ]
    return [*cmd, "--resume"] if launch.resume else cmd


def _start_ticks(pid: int) -> str | None:
    """Field 22 of ``/proc/<pid>/stat`` (start time in clock ticks): tells a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is alive (zombies do not count: an orphan's
    zombie waits for a reaper that may never come in a container)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


@dataclass
class _Child:
    pgid: int
    exit_file: Path
    popen: subprocess.Popen[bytes] | None  # None: adopted from an earlier scheduler process


def _exit_file(launch: Launch) -> Path:
    return launch.log.with_suffix(".exit")


def _pid_file(launch: Launch) -> Path:
    return launch.log.with_suffix(".pid")


class LocalBackend:
    """Child processes on this host; ``device`` is what every job trains on."""

    name = "local"

    def __init__(
        self,
        device: Literal["cpu", "cuda"] = "cpu",
        *,
        python: str = sys.executable,
        grace_s: float = 30.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.device, self.python, self.grace_s = device, python, grace_s
        self.env = dict(os.environ if env is None else env)
        self._children: dict[str, _Child] = {}
        self._ended: dict[str, int] = {}  # found ended on adoption, reported by the next poll

    def start(self, launch: Launch) -> None:
        assert launch.job_id not in self._children, f"{launch.job_id} is already running"
        launch.log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(self.env)
        if self.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in launch.devices)
        exit_file = _exit_file(launch)
        command = ["/bin/sh", "-c", _WRAPPER, "sh", str(exit_file)]
        command += trainer_command(launch, self.device, self.python)
        with launch.log.open("ab") as log:
            log.write(f"polytrain sched: {' '.join(command[5:])}\n".encode())
            log.flush()
            popen = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=launch.workdir,
                env=env,
                start_new_session=True,
            )
        record = {"pid": popen.pid, "start_ticks": _start_ticks(popen.pid)}
        tmp = _pid_file(launch).with_suffix(".pid.tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(_pid_file(launch))
        self._children[launch.job_id] = _Child(popen.pid, exit_file, popen)

    def stop(self, job_id: str) -> None:
        child = self._children.pop(job_id, None)
        if child is None:
            return
        for sig, wait_s in ((signal.SIGTERM, self.grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(child.pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while self._alive(child) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not self._alive(child):
                break

    def poll(self) -> dict[str, int]:
        ended, self._ended = self._ended, {}
        for job_id, child in list(self._children.items()):
            code = self._code(child)
            if code is None and not self._alive(child):
                code = self._code(child)  # it may have written the file just before exiting
                if code is None:  # killed without a word (not by us: stop() forgets it first)
                    status = child.popen.returncode if child.popen else None
                    code = status if status else -int(signal.SIGKILL)
            if code is not None:
                ended[job_id] = code
                del self._children[job_id]
        return ended

    def adopt(self, launch: Launch) -> bool:
        code = self._code(_Child(0, _exit_file(launch), None))
        if code is not None:
            self._ended[launch.job_id] = code
            return True
        try:
            record = json.loads(_pid_file(launch).read_text())
        except (OSError, ValueError):
            return False  # never started (the scheduler died between its state and its start)
        pid = int(record["pid"])
        leader = _start_ticks(pid)
        if leader is not None and leader != record.get("start_ticks"):
            return False  # the pid is another process's now
        child = _Child(pid, _exit_file(launch), None)
        if not self._alive(child):
            return False
        self._children[launch.job_id] = child
        return True

    @staticmethod
    def _code(child: _Child) -> int | None:
        try:
            return int(child.exit_file.read_text().strip())
        except (OSError, ValueError):
            return None

    @staticmethod
    def _alive(child: _Child) -> bool:
        if child.popen is not None:
            child.popen.poll()  # reap the shell once it exits
        return group_alive(child.pgid)

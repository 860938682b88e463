"""Run ``polytrain train`` as a user does and signal one of its workers mid-run.

The fault tests of the launcher (a SIGKILLed async PS worker or gossip peer, a SIGSTOPped
worker, a killed server) share one shape: start the command, wait until rank 0 has logged a
step, find the worker of a given rank among the launcher's children (by its ``RANK``
environment variable in /proc), send it a signal, and wait for the launcher to exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from polytrain.testing import scaled

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def start_train(*args: str, cwd: Path) -> subprocess.Popen[str]:
    """``polytrain train ARGS`` as a user starts it (this checkout on the path), pipes for
    its output."""
    return subprocess.Popen(
        [sys.executable, "-m", "polytrain.cli.app", "train", *args],
        cwd=cwd,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` for ``timeout`` seconds on an idle machine, ``scaled`` to this one."""
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _children(launcher: int) -> Iterator[tuple[int, Path]]:
    """(pid, /proc entry) of every process whose parent is ``launcher``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == launcher:
            yield int(entry.name), entry


def workers_of(launcher: int) -> list[int]:
    """Pids of the worker processes the launcher started."""
    found = []
    for pid, entry in _children(launcher):
        with contextlib.suppress(OSError):
            if b"polytrain.trainer.worker" in (entry / "cmdline").read_bytes():
                found.append(pid)
    return sorted(found)


def worker_of_rank(launcher: int, rank: int) -> int | None:
    """Pid of the launcher's child process whose environment has ``RANK=<rank>``."""
    for pid, entry in _children(launcher):
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    return None


def last_step(metrics: Path) -> int:
    """The largest step in a ``metrics.jsonl`` (-1 while there is none)."""
    if not metrics.exists():
        return -1
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line]
    return max(steps, default=-1)


@dataclass(frozen=True)
class SignalledRun:
    returncode: int
    stdout: str
    stderr: str
    signalled_at_step: int  # rank 0's last logged step when the signal was sent
    exit_after_s: float  # from the signal to the launcher's exit


def _hang_report(waited_s: float, stderr: str, metrics: Path) -> str:
    """What a run that did not end after the signal left behind: the launcher's stderr and each
    worker's log (``<out>/logs``, beside ``metrics``), their last lines."""
    parts = [
        f"the run did not end {waited_s:.0f} s after the signal; launcher stderr:",
        stderr[-3000:],
    ]
    for log in sorted((metrics.parent / "logs").glob("*/attempt_*/*/stderr.log")):
        parts += [f"--- {log.relative_to(metrics.parent)}:", log.read_text()[-2000:]]
    return "\n".join(parts)


def train_and_signal(
    args: Sequence[str],
    cwd: Path,
    metrics: Path,
    *,
    rank: int,
    sig: signal.Signals = signal.SIGKILL,
    after_step: int = 5,
    start_timeout_s: float = 60,
    end_timeout_s: float = 120,
) -> SignalledRun:
    """Run ``polytrain train ARGS``; send ``sig`` to worker ``rank`` once rank 0 has logged
    ``after_step`` (read from ``metrics``, so pass ``observe.log_every=1``); wait for the end.

    Both timeouts are scaled for a loaded machine. Nothing is left behind: the launcher is
    killed if it outlives the test, and a stopped worker is killed after the run.
    """
    launcher = start_train(*args, cwd=cwd)
    victim = None
    try:
        deadline = time.monotonic() + scaled(start_timeout_s)
        while last_step(metrics) < after_step:
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, f"rank 0 never reached step {after_step}"
            time.sleep(0.05)
        victim = worker_of_rank(launcher.pid, rank)
        assert victim is not None, f"rank {rank} not found among the launcher's children"
        os.kill(victim, sig)
        sent = time.monotonic()
        at_step = last_step(metrics)
        try:
            stdout, stderr = launcher.communicate(timeout=scaled(end_timeout_s))
        except subprocess.TimeoutExpired:
            launcher.kill()
            _, stderr = launcher.communicate()
            raise AssertionError(_hang_report(scaled(end_timeout_s), stderr, metrics)) from None
        exit_after = time.monotonic() - sent
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
        if victim is not None and sig == signal.SIGSTOP:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)  # never leave a stopped process behind
    return SignalledRun(launcher.returncode, stdout, stderr, at_step, exit_after)

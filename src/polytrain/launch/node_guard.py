"""Stop a node that has lost its network path to the rendezvous host.

[Note: lost node] When a host's link drops mid-run (a pulled cable, a dead switch port: no TCP
reset arrives), the workers on the *other* hosts fail their next collective within
``launch.timeout_s`` and say which ranks did not arrive (comm/watchdog.py). The workers on the
cut-off host are not so lucky: their failure handling writes to the agent's store, which lives
on the rendezvous side, and a store write over a dead link hangs; their elastic agent hangs in
the same way in its periodic rendezvous check. Measured on the emulated cluster: such a node
was still running minutes later.

`NodeGuard` watches the path from a non-hosting node's agent: a daemon thread checks a key
through its own store connection once a second and records each success; a second daemon thread
declares the node lost when no check succeeded for ``timeout_s``. It then prints one line naming
both hosts, kills this agent's worker processes (its own children, by pid) and exits the agent
with code 1. The hosting node needs no guard: it holds the store, and its workers time out.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

__all__ = ["NodeGuard", "child_pids", "stop_all"]

_RUNNING: list[NodeGuard] = []


def stop_all() -> None:
    """Stop every guard of this process: the job is over (or failed) and is exiting anyway."""
    for guard in _RUNNING:
        guard.stopped = True
    _RUNNING.clear()


def child_pids() -> list[int]:
    """This process's children (from every thread), read from /proc."""
    pids: list[int] = []
    for task in Path("/proc/self/task").iterdir():
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return pids


class NodeGuard:
    """Exit this node when the store at ``addr:port`` has not answered for ``timeout_s``."""

    def __init__(self, me: str, addr: str, port: int, timeout_s: float) -> None:
        self.me, self.addr, self.port, self.timeout_s = me, addr, port, timeout_s
        self.last_ok = time.monotonic()
        self.stopped = False
        self._started = False

    def start(self) -> None:
        """Start watching (idempotent); call once the node has joined the rendezvous."""
        if self._started:
            return
        self._started = True
        _RUNNING.append(self)
        threading.Thread(target=self._probe, name="polytrain-node-probe", daemon=True).start()
        threading.Thread(target=self._watch, name="polytrain-node-guard", daemon=True).start()

    def _probe(self) -> None:
        try:
            store = dist.TCPStore(
                self.addr,
                self.port,
                is_master=False,
                timeout=datetime.timedelta(seconds=self.timeout_s),
                use_libuv=True,
            )
        except Exception:
            return  # the watcher fires when no probe ever succeeds
        while not self.stopped:
            try:
                store.check(["polytrain/probe"])
                self.last_ok = time.monotonic()
            except Exception:
                pass
            time.sleep(1.0)

    def _watch(self) -> None:
        while not self.stopped and time.monotonic() - self.last_ok < self.timeout_s:
            time.sleep(0.5)
        if self.stopped:
            return
        print(
            f"polytrain: error: node {self.me} lost its network path to the rendezvous host "
            f"{self.addr} (no answer for {self.timeout_s:g} s): stopping this node's workers; "
            "check the link between the hosts",
            file=sys.stderr,
            flush=True,
        )
        for pid in child_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(1)

"""Colocated servers: the in-process link between a worker and the server on its own rank.

[Note: colocated servers] With ``ps.colocate`` (BytePS's colocated mode) there are no server
ranks: ranks ``0 .. ps.servers - 1`` are workers that also serve one shard each, the server's
loop running on a thread of its own (`ColocatedServer`). Each server ``s`` talks over its own
world-sized process group (``groups[s]``): on the pair between ranks ``a`` and ``b``, group
``a`` carries only worker ``b`` <-> server ``a`` and group ``b`` only worker ``a`` <->
server ``b``, so a rank's server thread and its worker thread never share a gloo pair (gloo
serialises a pair, and both threads block on their own receives). A worker's messages to the
server on its own rank do not touch gloo (which cannot send to itself): `LocalLink.deliver`
validates them like the receiver threads do and puts them on the server's inbox, a PUSH chunk
copied into the link's staging buffer (the local copy), and the server's replies to it (ACK,
the shard) are copied into the buffer the worker registered with its PULL and announced by
encoded headers on a queue, which the worker decodes like a remote reply. Sync mode only, not
hierarchical.

[Note: colocated checkpoints] A colocated server is checkpointed like a dedicated one ([Note:
parameter-server checkpoints] in polytrain.ps.strategy): its rank gives the checkpointer
(`Strategy.checkpoint_parts`) its replica's state with the server's shard in place of the
replica's copy of those weights, and the server's optimizer, so the rank that updates a weight
writes it. Two things differ from a server rank, whose loop is the loop's own:

- the save after step k must read the shard after k updates, but the server thread applies
  clock k - 1 once every worker's push is in, which may be after this rank's step returned:
  `before_save` waits for it (`ColocatedServer.wait_applied`). The thread cannot make the
  next update meanwhile: it needs this rank's push of clock k, which follows the save.
- a restore loads the shard and optimizer state in place and restarts the clocks, and no
  message may be handled before that: the thread starts at the rank's first train step,
  evaluation or final gather (`ColocatedServer.start`); the receivers queue what comes
  earlier (another rank that resumed sooner pulls at clock k).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from polytrain.ps.consistency import ClockTable
from polytrain.ps.protocol import Header, Op
from polytrain.ps.receive import Inbox

__all__ = ["ColocatedServer", "LocalLink"]

_POLL_S = 0.5


class LocalLink:
    """The worker on a server's own rank: its inbound staging and its reply queue.

    ``inbox`` is the server's inbox; ``decode(header, src)`` the server's header validation.
    """

    def __init__(
        self,
        worker: int,
        spans: list[tuple[int, int]],
        dtype: torch.dtype,
        inbox: Inbox,
        decode: Callable[[torch.Tensor, int], Header],
    ) -> None:
        self.worker, self.spans, self.inbox, self.decode = worker, spans, inbox, decode
        self.staging = torch.zeros(spans[-1][1] if spans else 0, dtype=dtype)
        self.dest: torch.Tensor | None = None  # where the next reply's shard goes
        self.replies: queue.Queue[torch.Tensor] = queue.Queue()
        self.failed: list[BaseException] = []  # the server thread's error, if it stopped

    # --- worker thread -------------------------------------------------------------------

    def deliver(self, header: Header, payload: torch.Tensor | None = None) -> None:
        """A message from the local worker: PUSH ``payload`` is its chunk; PULL and the
        coordinator's LEAVE pass the buffer the shard is to be copied into."""
        self.raise_if_failed()
        arrived = time.perf_counter()
        checked = self.decode(header.encode(), self.worker)
        body = None
        if checked.op is Op.PUSH:
            start, stop = self.spans[checked.chunk]
            assert payload is not None and payload.numel() == stop - start
            self.staging[start:stop].copy_(payload)
            body = self.staging
        elif checked.op in (Op.PULL, Op.LEAVE) and payload is not None:
            self.dest = payload
        self.inbox.put(("msg", self.worker, checked, body, (arrived, time.perf_counter())))

    def reply(self) -> torch.Tensor:
        """The next reply header (encoded). Waits as long as the server thread is alive and
        serving (it is in this process: a slow grant is a slow worker elsewhere, not a hang
        the heartbeat watch of remote servers would need to catch)."""
        while True:
            self.raise_if_failed()
            try:
                return self.replies.get(timeout=_POLL_S)
            except queue.Empty:
                continue

    def raise_if_failed(self) -> None:
        if self.failed:
            raise RuntimeError(
                f"the colocated server on rank {self.worker} stopped: {self.failed[0]}"
            ) from self.failed[0]

    # --- server thread -------------------------------------------------------------------

    def send(self, header: Header, shard: torch.Tensor | None = None) -> None:
        """A reply to the local worker: the shard (a PARAMS reply) is copied first."""
        if shard is not None:
            assert self.dest is not None, "the local worker registered no buffer for the shard"
            self.dest.copy_(shard)
        self.replies.put(header.encode())


class _Serving(Protocol):
    """What `ColocatedServer` runs: `polytrain.ps.server.ParameterServer` (which imports
    this module, so it is named structurally here)."""

    table: ClockTable
    applied: int

    def finish(self, out_dir: str) -> None: ...


class ColocatedServer:
    """Runs a server's `finish` loop on a daemon thread from `start` on; its error reaches the
    worker through the `LocalLink` (and `check`)."""

    def __init__(self, server: _Serving, link: LocalLink, out_dir: str) -> None:
        self.server, self.link = server, link
        self.thread = threading.Thread(target=self._run, args=(out_dir,), name="ps-colocated")
        self.thread.daemon = True

    def start(self) -> None:
        """Start serving (once; after a restore, [Note: colocated checkpoints])."""
        if self.thread.ident is None:
            self.thread.start()

    def _run(self, out_dir: str) -> None:
        try:
            self.server.finish(out_dir)
        except BaseException as exc:  # handed to the worker thread, which raises it
            self.link.failed.append(exc)

    def check(self) -> None:
        self.link.raise_if_failed()

    def wait_handled(self, clock: int) -> None:
        """Wait until this server has handled every worker's push of ``clock`` (applied, or
        dropped as NaN, or stopped on it). A rank that is about to stop on a NaN step waits
        here, so its exit cannot cut off another rank's push to this server mid-transfer."""
        while self.thread.is_alive() and not self.link.failed:
            if self.server.table.min_clock() > clock:
                return
            self.thread.join(timeout=0.01)

    def wait_applied(self, clock: int) -> None:
        """Wait until this server has made the updates of clocks ``0 .. clock - 1`` (applied or
        dropped as NaN; [Note: colocated checkpoints]); raise its error if it stopped."""
        while self.server.applied < clock:
            if not self.thread.is_alive():
                self.check()
                raise RuntimeError(
                    f"the colocated server on rank {self.link.worker} is not serving: it made "
                    f"{self.server.applied} of {clock} updates"
                )
            self.thread.join(timeout=0.01)

    def join(self) -> None:
        """Wait for the server to stop (after the coordinator's SHUTDOWN); raise its error."""
        while self.thread.is_alive():
            self.thread.join(timeout=_POLL_S)
            self.check()
        self.check()

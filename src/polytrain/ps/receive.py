"""The receiving side of one parameter server: request validation and one receiver per worker.

The receiver threads of [Note: server threads] in `polytrain.ps.server`: one per remote worker,
handing the server's main thread ``("msg", src, header, payload, when)`` items through its inbox
(``when``: `time.perf_counter` when the header arrived and when the message was complete, for
[Note: transfer windows]), or one ``("lost" | "error" | "failed", src, why, None, when)`` when
that worker's stream ends.

[Note: staging in place] Each receiver thread owns its worker's staging buffer (P + 1 elements)
and receives every PUSH chunk straight into its slice, borrowing the element after the slice as
the payload guard ([Note: payload guard] in `polytrain.comm.ps_wire`) and putting it back after
the check, so chunks may arrive in any order (last layers first) and nothing is allocated or
copied per chunk. The main thread reads the buffer only when the push's CLOCK arrives, and the
receiver writes it again only for the worker's next push, which follows a pull the main thread
grants after handling that CLOCK: the two threads never touch the buffer at the same time.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable
from typing import Any, TypeAlias

import torch

from polytrain.comm import ps_wire
from polytrain.comm.ps_wire import PeerLost
from polytrain.errors import ProtocolError
from polytrain.ps.layout import ShardLayout
from polytrain.ps.protocol import HEADER_LEN, Header, Op

__all__ = ["Arrival", "Inbox", "Receivers"]

Arrival: TypeAlias = tuple[float, float]
"""`time.perf_counter` when a message's header arrived, and when the message was complete."""
Inbox: TypeAlias = queue.Queue[tuple[str, int, Any, Any, Arrival]]

_WORKER_OPS = frozenset({Op.PULL, Op.PUSH, Op.CLOCK, Op.JOIN, Op.LEAVE, Op.SHUTDOWN})


class Receivers:
    """What server ``index`` receives from its workers: `decode` validates a request header
    (for the receiver threads and a colocated worker's `LocalLink`); `start` runs one receiver
    thread per remote worker, feeding ``inbox``."""

    def __init__(
        self,
        *,
        index: int,
        layout: ShardLayout,
        num_worker_slots: int,
        coordinator: int,
        group: ps_wire.Group,
        inbox: Inbox,
    ) -> None:
        self.index, self.layout, self.num_worker_slots = index, layout, num_worker_slots
        self.coordinator, self.group, self.inbox = coordinator, group, inbox
        self.spans = layout.spans(index)
        self.threads: list[threading.Thread] = []

    def start(self, workers: Iterable[int]) -> None:
        """One receiver thread for each of ``workers`` (daemons: a dropped worker that is still
        alive keeps its thread blocked)."""
        threads = [
            threading.Thread(target=self._receive, args=(w,), name=f"ps-recv-{w}", daemon=True)
            for w in workers
        ]
        self.threads += threads
        for thread in threads:
            thread.start()

    def join(self, timeout_s: float) -> None:
        for thread in self.threads:
            thread.join(timeout=timeout_s)

    def _receive(self, src: int) -> None:
        """Blocking receives from worker ``src``; hands ("msg", src, header, payload) items to
        the main thread. One thread per worker: a receive from any source would fail again and
        again once one peer's connection broke, and a dead peer must only end its own stream.
        """
        # [Note: staging in place]: this worker's staging buffer, one guard element longer.
        staging = torch.zeros(self.layout.numel(self.index) + 1, dtype=self.layout.dtype)
        while True:
            wire = torch.zeros(HEADER_LEN, dtype=torch.int64)
            try:
                ps_wire.wait_all([ps_wire.post_recv(wire, src, ps_wire.TAG_REQUEST, self.group)])
                arrived = time.perf_counter()
                header = self.decode(wire, src)
                payload = None
                if header.op is Op.PUSH:
                    start, stop = self.spans[header.chunk]
                    window = staging[start : stop + 1]
                    borrowed = window[-1].clone()  # the next chunk's first element, if in
                    ps_wire.arm_guard(window)
                    op = ps_wire.post_recv(window, src, ps_wire.TAG_PUSH, self.group)
                    ps_wire.wait_all([op])
                    ps_wire.check_guarded(window, src)
                    window[-1] = borrowed
                    payload = staging[:-1]
            except PeerLost as exc:
                self.inbox.put(("lost", src, str(exc), None, _now()))
                return
            except ProtocolError as exc:
                # The stream from ``src`` is out of step: stop receiving, report, apply nothing.
                self.inbox.put(("error", src, exc, None, _now()))
                return
            except Exception as exc:  # e.g. the group torn down under a failed colocated rank
                self.inbox.put(("failed", src, f"{type(exc).__name__}: {exc}", None, _now()))
                return
            self.inbox.put(("msg", src, header, payload, (arrived, time.perf_counter())))
            if header.op is Op.SHUTDOWN or (header.op is Op.LEAVE and src != self.coordinator):
                return

    def decode(self, wire: torch.Tensor, src: int) -> Header:
        """The request header ``wire`` from rank ``src``, validated for this server's shard;
        `ProtocolError` naming the rank and the field otherwise."""
        try:
            header = Header.decode(
                wire,
                expect_job=self.layout.job_id,
                num_workers=self.num_worker_slots,
                num_shards=self.layout.num_servers,
                expect_ops=_WORKER_OPS,
            )
        except ProtocolError as exc:
            raise ProtocolError(f"server {self.index}: message from rank {src}: {exc}") from None
        where = f"server {self.index}: {header.op.name} from rank {src}"
        if header.worker != src:
            raise ProtocolError(f"{where}: header field worker = {header.worker}: expected {src}")
        if header.shard != self.index:
            raise ProtocolError(
                f"{where}: header field shard = {header.shard}: expected {self.index} "
                f"(this server's shard)"
            )
        if header.op is Op.PUSH:
            if header.num_chunks != len(self.spans):
                raise ProtocolError(
                    f"{where}: header field num_chunks = {header.num_chunks}: expected "
                    f"{len(self.spans)}"
                )
            start, stop = self.spans[header.chunk]
            if header.numel != stop - start or header.dtype != self.layout.dtype_code:
                raise ProtocolError(
                    f"{where}: chunk {header.chunk} announces numel = {header.numel}, dtype "
                    f"code {header.dtype}: expected {stop - start}, {self.layout.dtype_code}"
                )
        return header


def _now() -> Arrival:
    now = time.perf_counter()
    return now, now

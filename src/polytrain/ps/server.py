"""One parameter-server rank: holds a shard, runs its optimizer, answers pushes and pulls.

The sharded server of DistBelief (Dean et al., NIPS 2012) and Li et al. (OSDI 2014) with the
consistency models of `polytrain.ps.consistency` (sync, async / Downpour, SSP of Ho et al.,
NIPS 2013). The shard, its optimizer and the update made from the pushes are `ServerShard`'s
(`polytrain.ps.shard`); this module receives, answers and keeps track of the workers.

[Note: server threads] One receiver thread per worker blocks on that worker's next header and,
for a PUSH, on its payload; it decodes and validates every message ([Note: validate before use] in
`polytrain.ps.protocol`) and hands it to the main thread through a queue (`polytrain.ps.receive`,
[Note: staging in place]). The main thread owns all state (clocks, buffers, optimizer) and all
sends. It wakes up at least every `_POLL_S` seconds, so it can notice dead workers without ever
waiting on gloo with a timeout ([Note: no timeouts on gloo waits] in `polytrain.comm.ps_wire`).

[Note: atomic pushes] A push is a sequence of chunks followed by a CLOCK message. Chunks land in
a per-worker staging buffer and reach the parameters (async, ssp) or the clock's sum (sync) only
when the CLOCK arrives with every chunk in. A worker that dies mid-push, or a chunk that fails
validation, therefore changes nothing.

[Note: replies never wait] A worker posts the receives of a reply (ACK, then every PARAMS
chunk of every server) before it sends the request, and the coordinator posts those of the
final shards before its LEAVE. So a server's blocking wait on its reply sends only waits for
the transfer itself, never for a worker that is busy waiting on another server (which would
be a cycle: two servers each granting one of two workers that waits for the other server).

Per clock a server also records its transfer windows (`polytrain.ps.stats`, [Note: transfer
windows]).
"""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from polytrain.comm import ps_wire
from polytrain.comm.ps_wire import PeerLost
from polytrain.config.job import OptimConfig
from polytrain.errors import ProtocolError
from polytrain.ps.consistency import ClockTable, Mode, SyncAggregator, may_proceed
from polytrain.ps.layout import ShardLayout
from polytrain.ps.local import LocalLink
from polytrain.ps.protocol import Header, Op
from polytrain.ps.receive import Inbox, Receivers
from polytrain.ps.shard import ServerShard

__all__ = ["ParameterServer"]

_POLL_S = 0.2
_PROBE_AFTER_S = 1.0


class ParameterServer(ServerShard):
    """Server ``index`` of the job; talks to worker ranks ``workers`` (the pushers).

    ``spares`` are worker ranks that are not live at the start and may JOIN later. The shard
    arguments are `ServerShard`'s.
    """

    def __init__(
        self,
        *,
        index: int,
        layout: ShardLayout,
        initial: dict[str, torch.Tensor],
        optim: OptimConfig,
        lr_at: Callable[[int], float],
        mode: Mode,
        staleness: int,
        workers: list[int],
        spares: list[int],
        num_worker_slots: int,
        num_pushers: int,
        coordinator: int = 0,
        server_group: Any = None,
        worker_timeout_s: float = 300.0,
        on_nonfinite: Literal["stop", "skip"] = "stop",
        group: ps_wire.Group = None,
        local: int | None = None,
        label: str = "",
    ) -> None:
        """``label``: the name of its heartbeat and stats file (default ``server<index>``)."""
        super().__init__(
            index=index,
            layout=layout,
            initial=initial,
            optim=optim,
            lr_at=lr_at,
            mode=mode,
            staleness=staleness,
            workers=workers,
            num_pushers=num_pushers,
            server_group=server_group,
            on_nonfinite=on_nonfinite,
        )
        self.label = label or f"server{index}"
        self.num_worker_slots, self.coordinator = num_worker_slots, coordinator
        self.worker_timeout_s = worker_timeout_s
        self.staging: dict[int, torch.Tensor] = {}
        self.chunks_in: dict[int, set[int]] = {}
        self.state: dict[int, str] = {w: "live" for w in workers}
        self.state.update({w: "pending" for w in spares})
        now = time.monotonic()
        self.last_heard = dict.fromkeys(self.state, now)
        self.last_probe = dict.fromkeys(self.state, now)
        self.deferred: list[tuple[int, int]] = []  # (worker, clock) pulls not yet granted
        self.granted: dict[int, int] = {}  # worker -> clock of its latest granted pull
        self.shutdown_received = False
        self.started = time.perf_counter()
        self._inbox: Inbox = queue.Queue()
        # [Note: colocated servers] in polytrain.ps.local: the worker on this rank, if any,
        # talks through `link` instead of gloo; everyone else over ``group``.
        self.group = group
        self.receivers = Receivers(
            index=index,
            layout=layout,
            num_worker_slots=num_worker_slots,
            coordinator=coordinator,
            group=group,
            inbox=self._inbox,
        )
        self.link: LocalLink | None = None
        if local is not None:
            decode = self.receivers.decode
            self.link = LocalLink(local, self.spans, self.flat.dtype, self._inbox, decode)
        self.receivers.start(w for w in sorted(self.state) if w != local)

    # --- main thread ---------------------------------------------------------------------

    @property
    def active(self) -> list[int]:
        """Workers that are live or have yet to join."""
        return sorted(w for w, s in self.state.items() if s in ("live", "pending"))

    def resume_at(self, clock: int) -> None:
        """Restart the clocks at ``clock`` (a resumed job; before any message is handled).

        The shard and optimizer state were loaded in place by the checkpointer; the live
        workers' clocks, the sync aggregator and so the learning-rate schedule continue from
        the resumed step. Spare workers joining later start at or above it.
        """
        live = [w for w, s in self.state.items() if s == "live"]
        self.table = ClockTable(live, clock=clock)
        self.applied = clock
        if self.aggregator is not None:
            self.aggregator = SyncAggregator(live, clock=clock)

    def serve_until_pulled(self, clock: int) -> None:
        """Serve until every live worker has been granted its pull of ``clock``."""
        self._serve(lambda: all(self.granted.get(w, -1) >= clock for w in self.table.workers))

    def serve_until_clock(self, clock: int) -> None:
        """Serve until every live worker has completed ``clock`` clocks (or none is left)."""
        self._serve(lambda: not self.active or self.table.min_clock() >= clock)

    def finish(self, out_dir: str = "") -> None:
        """Serve until every worker has left, hand the shard to the coordinator, stop."""
        self._serve(lambda: not self.active)
        ops = self._params_ops(self.coordinator, self.table.min_clock())
        ps_wire.wait_all(ops)
        self._serve(lambda: self.shutdown_received)
        self.receivers.join(timeout_s=1)  # a dropped worker that is still alive keeps its thread
        if out_dir:
            self.write_stats(Path(out_dir) / "ps" / f"{self.label}.json")

    def metrics(self) -> dict[str, float]:
        wall = max(time.perf_counter() - self.started, 1e-9)
        s = self.stats
        return {
            "ps_updates": float(s.updates),
            "ps_updates_per_s": s.updates / wall,
            "ps_bytes_per_s": (s.bytes_in + s.bytes_out) / wall,
            "ps_live_workers": float(len(self.table)),
            "ps_skipped_updates": float(len(s.skipped)),
        }

    def write_stats(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "server": self.index,
            "mode": self.mode,
            "staleness": self.staleness,
            "wall_s": time.perf_counter() - self.started,
            **self.stats.record(),
            **self.metrics(),
        }
        path.write_text(json.dumps(record))

    def _serve(self, done: Callable[[], bool]) -> None:
        while not done():
            ps_wire.heartbeat(self.label)  # [Note: hung server] in comm.ps_wire
            try:
                kind, src, a, b, when = self._inbox.get(timeout=_POLL_S)
            except queue.Empty:
                self._check_liveness()
                self._grant_ready()
                continue
            if kind == "msg":
                self.last_heard[src] = time.monotonic()
                self._handle(a, b, when)
            elif kind == "lost":
                self._drop(src, f"lost: {a}")
            elif kind == "error":
                raise a
            else:
                raise RuntimeError(f"server {self.index}: receiving failed: {a}")
            self._grant_ready()

    def _check_liveness(self) -> None:
        """Probe workers silent for a while; drop those that are gone or silent too long."""
        now = time.monotonic()
        for w in self.active:
            if self.link is not None and w == self.link.worker:
                continue  # the worker on this rank: alive while this process is
            silent = now - self.last_heard[w]
            if silent < _PROBE_AFTER_S or now - self.last_probe[w] < _PROBE_AFTER_S:
                continue
            self.last_probe[w] = now
            if ps_wire.peer_is_gone(w, self.group):
                self._drop(w, "its process is gone (connection closed)")
            elif silent > self.worker_timeout_s and self.state[w] == "live":  # spares wait
                self._drop(w, f"silent for {silent:.0f} s > ps.worker_timeout_s")

    def _handle(
        self, header: Header, payload: torch.Tensor | None, when: tuple[float, float] = (0, 0)
    ) -> None:
        """One message; ``when``: its arrival (`polytrain.ps.receive.Arrival`)."""
        w, op = header.worker, header.op
        if op is Op.SHUTDOWN:
            if w != self.coordinator:
                raise ProtocolError(f"SHUTDOWN from rank {w}: only rank {self.coordinator} may")
            self.shutdown_received = True
            return
        if op is Op.JOIN:
            self._join(w)
            return
        if op is Op.LEAVE and self.state.get(w) == "pending":  # a spare that never joined
            self.state[w] = "left"
            self.stats.left.append((w, -1))
            return
        if self.state.get(w) != "live":
            if op is Op.PULL:  # a worker we dropped is still running: tell it to stop
                self._reply(w, Header(Op.SHUTDOWN, w, 0, self.layout.job_id, shard=self.index))
            return
        clock = self.table.clock(w)
        if op is not Op.LEAVE and header.clock != clock:
            raise ProtocolError(
                f"server {self.index}: {op.name} from worker {w} carries clock {header.clock}: "
                f"expected {clock}; a message was lost or repeated"
            )
        if op is Op.PULL:
            self.deferred.append((w, clock))
        elif op is Op.PUSH:
            assert payload is not None
            start, stop = self.spans[header.chunk]
            self.staging[w] = payload  # already in place ([Note: staging in place] in ps.receive)
            self.chunks_in.setdefault(w, set()).add(header.chunk)
            self.stats.bytes_in += (stop - start) * payload.element_size()
            window = self.stats.window(clock)
            window.push_start = min(window.push_start, when[0])
            window.push_end = max(window.push_end, when[1])
            window.push_bytes += (stop - start) * payload.element_size()
        elif op is Op.CLOCK:
            self._clock(w, clock)
        elif op is Op.LEAVE:
            self.state[w] = "left"
            self.stats.left.append((w, clock))
            self._remove(w)

    def _clock(self, w: int, clock: int) -> None:
        chunks = self.chunks_in.pop(w, set())
        if chunks and len(chunks) != len(self.spans):
            raise ProtocolError(
                f"server {self.index}: CLOCK {clock} from worker {w} after {len(chunks)} of "
                f"{len(self.spans)} chunks: a push must be complete before its clock"
            )
        self.table.advance(w, clock)
        if chunks:
            self.stats.pushes += 1
        if self.aggregator is not None:
            if chunks:
                self.sum_flat += self.staging[w]
            if self.aggregator.add(w, clock):
                self._apply_sum()
        elif chunks:
            self.grad_flat.copy_(self.staging[w]).div_(self.num_pushers)
            self._step(clock)

    def _join(self, w: int) -> None:
        if self.state.get(w) != "pending":
            raise ProtocolError(
                f"server {self.index}: JOIN from worker {w}, which is {self.state.get(w)}: "
                f"only a spare worker (ps.spare_workers) may join, once"
            )
        start = self.table.add_worker(w)
        if self.aggregator is not None:
            self.aggregator.add_worker(w)
        self.state[w] = "live"
        self.stats.joined.append((w, start))
        self._reply(w, Header(Op.ACK, w, start, self.layout.job_id, shard=self.index))

    def _drop(self, w: int, why: str) -> None:
        if self.state.get(w) not in ("live", "pending"):
            return
        clock = self.table.clock(w) if w in self.table else -1
        was_live = self.state[w] == "live"
        self.state[w] = "dead"
        self.stats.removed.append((w, clock, why))
        if was_live:
            self._remove(w)

    def _remove(self, w: int) -> None:
        self.table.remove_worker(w)
        self.staging.pop(w, None)
        self.chunks_in.pop(w, None)
        self.deferred = [(v, c) for v, c in self.deferred if v != w]
        if self.aggregator is not None and self.aggregator.remove_worker(w):
            self._apply_sum()

    def _grant_ready(self) -> None:
        """Answer every deferred pull the consistency rule now allows (may_proceed).

        The replies to every grantable pull are posted before any is waited for, so the
        workers' pulls stream concurrently instead of one worker after another.
        """
        while True:
            floor = self.table.min_clock()
            shown = self._grant_floor(floor)
            ready = [
                (w, c) for w, c in self.deferred if may_proceed(self.mode, self.staleness, c, floor)
            ]
            if not ready:
                return
            self.deferred = [d for d in self.deferred if d not in ready]
            posted = []
            shard_bytes = self.flat.numel() * self.flat.element_size()
            for w, clock in ready:
                window = self.stats.window(clock)
                window.pull_start = min(window.pull_start, time.perf_counter())
                ack = Header(Op.ACK, w, shown, self.layout.job_id, shard=self.index)
                try:
                    if self.link is not None and w == self.link.worker:
                        self.link.send(ack, self.flat)  # [Note: colocated servers]
                        self.stats.bytes_out += self.flat.numel() * self.flat.element_size()
                        ops = []
                    else:
                        ops = [self._send_header(ack), *self._params_ops(w, clock)]
                except PeerLost as exc:
                    self._drop(w, f"lost: {exc}")
                    continue
                posted.append((w, clock, ops))
            for w, clock, ops in posted:
                try:
                    ps_wire.wait_all(ops)
                except PeerLost as exc:
                    self._drop(w, f"lost: {exc}")
                    continue
                self.granted[w] = clock
                window = self.stats.window(clock)
                window.pull_end = max(window.pull_end, time.perf_counter())
                window.pull_bytes += shard_bytes
                self.stats.events.append((w, clock, shown))
                self.stats.grants += 1

    def _grant_floor(self, floor: int) -> int:
        """The slowest clock a grant reports (ACK, events): this server's ``min_clock``; a
        leaf reports its root's ([Note: leaf servers] in polytrain.ps.leaf)."""
        return floor

    def _send_header(self, header: Header) -> Any:
        return ps_wire.post_send(header.encode(), header.worker, ps_wire.TAG_REPLY, self.group)

    def _params_header(
        self, dst: int, clock: int, chunk: int, num_chunks: int, numel: int
    ) -> Header:
        """Chunk ``chunk`` of ``num_chunks`` of this shard's PARAMS reply to worker ``dst``."""
        return Header(
            Op.PARAMS,
            dst,
            clock,
            self.layout.job_id,
            shard=self.index,
            chunk=chunk,
            num_chunks=num_chunks,
            numel=numel,
            dtype=self.layout.dtype_code,
        )

    def _params_ops(self, dst: int, clock: int) -> list[Any]:
        if self.link is not None and dst == self.link.worker:
            # The coordinator on this rank: the final shard is copied, then one PARAMS header
            # announces it ([Note: colocated servers] in polytrain.ps.local).
            self.link.send(self._params_header(dst, clock, 0, 1, self.flat.numel()), self.flat)
            self.stats.bytes_out += self.flat.numel() * self.flat.element_size()
            return []
        ops = []
        for k, (start, stop) in enumerate(self.spans):
            header = self._params_header(dst, clock, k, len(self.spans), stop - start)
            ops.append(self._send_header(header))
            ops.append(
                ps_wire.post_send(self.flat[start:stop], dst, ps_wire.TAG_PARAMS, self.group)
            )
            self.stats.bytes_out += (stop - start) * self.flat.element_size()
        return ops

    def _reply(self, w: int, header: Header) -> None:
        if self.link is not None and w == self.link.worker:
            self.link.send(header)
            return
        try:
            ps_wire.wait_all([self._send_header(header)])
        except PeerLost as exc:
            self._drop(w, f"lost: {exc}")

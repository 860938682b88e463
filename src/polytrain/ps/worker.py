"""The worker side of the parameter-server protocol: pull, push, join, leave, final weights.

Pulls and pushes move each server's flat shard in chunks, all posted before any is waited for,
so transfers of different chunks and of different servers overlap (PAI's pipelined chunked
communication; the push/pull interface of Li et al., OSDI 2014). Shapes: P_s = elements of
server s's shard.
"""

from __future__ import annotations

from typing import Any

import torch

from polytrain.comm import ps_wire
from polytrain.errors import PolytrainError, ProtocolError
from polytrain.ps.layout import ShardLayout
from polytrain.ps.local import LocalLink
from polytrain.ps.protocol import HEADER_LEN, Header, Op

__all__ = ["PendingPull", "PostedPull", "RemovedError", "WorkerClient"]


class RemovedError(PolytrainError):
    """A server dropped this worker (it was silent for longer than ps.worker_timeout_s)."""


class WorkerClient:
    """Worker ``worker`` (its global rank) talking to the server ranks ``servers``."""

    def __init__(
        self,
        worker: int,
        layout: ShardLayout,
        servers: list[int],
        num_worker_slots: int,
        reply_timeout_s: float = 300.0,
        groups: list[ps_wire.Group] | None = None,
        local: LocalLink | None = None,
        names: list[str] | None = None,
    ) -> None:
        """``groups[s]``: the group server ``s`` talks over (default: the world);
        ``local``: the link to the server on this rank ([Note: colocated servers]);
        ``names[s]``: server ``s``'s heartbeat name (default ``server<s>``)."""
        self.names = names or [f"server{s}" for s in range(len(servers))]
        self.worker, self.layout, self.servers = worker, layout, servers
        self.groups: list[ps_wire.Group] = groups or [None] * len(servers)
        self.local = local
        self.local_shard = servers.index(worker) if local is not None else -1
        self.num_worker_slots = num_worker_slots
        self.reply_timeout_s = reply_timeout_s  # [Note: hung server] in comm.ps_wire
        self.bytes_sent = 0
        self.bytes_received = 0
        self._push_ops: list[Any] = []

    def _header(self, op: Op, clock: int, shard: int, **kw: int) -> Header:
        return Header(op, self.worker, clock, self.layout.job_id, shard=shard, **kw)

    def _decode(self, wire: torch.Tensor, ops: set[Op], numel: int | None = None) -> Header:
        header = Header.decode(
            wire,
            expect_job=self.layout.job_id,
            num_workers=self.num_worker_slots,
            num_shards=self.layout.num_servers,
            expect_numel=numel,
            expect_ops=ops,
        )
        if header.worker != self.worker:
            raise ProtocolError(
                f"reply addressed to worker {header.worker} reached worker {self.worker}"
            )
        return header

    def _send_all(self, op: Op, clock: int, local_buffer: torch.Tensor | None = None) -> None:
        """``op`` to every server; the one on this rank gets ``local_buffer`` (where its
        reply's shard goes) with it."""
        ps_wire.wait_all(self._post_all(op, clock, local_buffer))

    def _post_all(self, op: Op, clock: int, local_buffer: torch.Tensor | None = None) -> list[Any]:
        """`_send_all` without the wait: the posted sends."""
        ops = []
        for s, rank in enumerate(self.servers):
            header = self._header(op, clock, s)
            if s == self.local_shard:
                assert self.local is not None
                self.local.deliver(header, local_buffer)
            else:
                wire = header.encode()
                ops.append(ps_wire.post_send(wire, rank, ps_wire.TAG_REQUEST, self.groups[s]))
        return ops

    def _local_reply(self, wires: list[torch.Tensor]) -> None:
        """The local server's reply header into its slot of ``wires`` (after the copy)."""
        if self.local is not None:
            wires[self.local_shard].copy_(self.local.reply())

    def _post_acks(self) -> tuple[list[torch.Tensor], list[Any]]:
        wires = [torch.zeros(HEADER_LEN, dtype=torch.int64) for _ in self.servers]
        ops = [
            ps_wire.post_recv(w, r, ps_wire.TAG_REPLY, self.groups[s])
            for s, (w, r) in enumerate(zip(wires, self.servers, strict=True))
            if s != self.local_shard
        ]
        return wires, ops

    def _wait_replies(self, ops: list[Any], what: str) -> None:
        """Wait for replies from the servers, naming a server that hangs ([Note: hung server]).

        Each server's operations are waited for in server order; every receive was posted
        before the request, so the order delays nothing."""
        for s, rank in enumerate(self.servers):
            mine = [op for op in ops if op.peer == rank]
            ps_wire.wait_all_watched(mine, rank, self.names[s], self.reply_timeout_s, what)

    def _check_acks(self, wires: list[torch.Tensor]) -> list[int]:
        """The clock field of every server's ACK (in server order)."""
        clocks = []
        for s, wire in enumerate(wires):
            header = self._decode(wire, {Op.ACK, Op.SHUTDOWN})
            if header.op is Op.SHUTDOWN:
                raise RemovedError(
                    f"server {s} dropped worker {self.worker} (silent for longer than "
                    f"ps.worker_timeout_s): raise the timeout for slow workers"
                )
            clocks.append(header.clock)
        return clocks

    def _post_params(self) -> tuple[list[torch.Tensor], list[Any], list[Any]]:
        """Post the receives of every chunk of every server's shard at once."""
        flats = [
            torch.empty(self.layout.numel(s), dtype=self.layout.dtype)
            for s in range(len(self.servers))
        ]
        wires: list[tuple[int, int, torch.Tensor]] = []
        ops = []
        for s, rank in enumerate(self.servers):
            if s == self.local_shard:  # copied in by the server thread
                continue
            group = self.groups[s]
            for k, (start, stop) in enumerate(self.layout.spans(s)):
                wire = torch.zeros(HEADER_LEN, dtype=torch.int64)
                wires.append((s, k, wire))
                ops.append(ps_wire.post_recv(wire, rank, ps_wire.TAG_REPLY, group))
                ops.append(ps_wire.post_recv(flats[s][start:stop], rank, ps_wire.TAG_PARAMS, group))
        return flats, wires, ops

    def _check_params(self, flats: list[torch.Tensor], wires: list[Any]) -> None:
        """Validate every chunk header before the shard is used."""
        for s, k, wire in wires:
            self.check_chunk(s, k, wire, flats[s].element_size())

    def check_chunk(self, s: int, k: int, wire: torch.Tensor, itemsize: int) -> None:
        start, stop = self.layout.spans(s)[k]
        header = self._decode(wire, {Op.PARAMS}, numel=stop - start)
        if header.shard != s or header.chunk != k:
            raise ProtocolError(
                f"PARAMS chunk {header.chunk} of shard {header.shard} arrived where chunk "
                f"{k} of shard {s} was expected"
            )
        self.bytes_received += (stop - start) * itemsize

    def pull(self, clock: int) -> tuple[list[torch.Tensor], list[int]]:
        """Ask for the parameters to run clock ``clock``; block until every server grants it.

        Returns each server's flat shard and the slowest worker's clock each server saw when
        it granted the pull (the worker's staleness is ``clock - min_clock``). Every receive
        is posted before the request goes out, so a server's reply never waits for this
        worker ([Note: replies never wait] in polytrain.ps.server).
        """
        pending = self.begin_pull(clock)
        pending.wait_rest()
        return pending.flats, pending.floors

    def begin_pull(self, clock: int) -> PendingPull:
        """`pull` up to the grants: every server has answered (ACK), its chunks are still on
        the wire; `PendingPull.wait_chunk` waits for one ([Note: prioritised overlap] in
        polytrain.ps.overlap)."""
        return self.post_pull(clock).granted()

    def post_pull(self, clock: int) -> PostedPull:
        """Post a pull of ``clock`` and return at once: every receive (ACK, every chunk),
        then the PULL to every server; `PostedPull.granted` waits for the grants. Posted
        with the push's CLOCK, the pull waits at the server while the worker is elsewhere
        ([Note: pull with the clock] in polytrain.ps.overlap)."""
        wires, ack_ops = self._post_acks()
        flats, chunk_wires, chunk_ops = self._post_params()
        local_flat = flats[self.local_shard] if self.local is not None else None
        sends = self._post_all(Op.PULL, clock, local_flat)
        chunks = (flats, chunk_wires, chunk_ops)
        return PostedPull(self, clock, wires, ack_ops, chunks, sends)

    def post_chunk(self, clock: int, shard: int, chunk: int, payload: torch.Tensor) -> None:
        """Post chunk ``chunk`` of this worker's push of ``clock`` to server ``shard``; the
        sends complete in `end_push`."""
        num_chunks = len(self.layout.spans(shard))
        header = self._header(
            Op.PUSH,
            clock,
            shard,
            chunk=chunk,
            num_chunks=num_chunks,
            numel=payload.numel(),
            dtype=self.layout.dtype_code,
        )
        if shard == self.local_shard:  # a local copy ([Note: colocated servers])
            assert self.local is not None
            self.local.deliver(header, payload)
            return
        rank, group = self.servers[shard], self.groups[shard]
        self._push_ops.append(ps_wire.post_send(header.encode(), rank, ps_wire.TAG_REQUEST, group))
        self._push_ops.append(ps_wire.post_send(payload, rank, ps_wire.TAG_PUSH, group))
        self.bytes_sent += payload.numel() * payload.element_size()

    def wait_chunks(self) -> None:
        """Wait until every posted chunk has been sent (its buffer may be reused)."""
        ops, self._push_ops = self._push_ops, []
        ps_wire.wait_all(ops)

    def end_push(self, clock: int) -> None:
        """Complete the push of ``clock``: CLOCK to every server after its chunks, then wait."""
        self.post_clock(clock)
        self.wait_chunks()

    def post_clock(self, clock: int) -> None:
        """Post the CLOCK of ``clock`` to every server after its chunks; `wait_chunks`
        completes the sends."""
        for s, rank in enumerate(self.servers):
            header = self._header(Op.CLOCK, clock, s)
            if s == self.local_shard:
                assert self.local is not None
                self.local.deliver(header)
                continue
            op = ps_wire.post_send(header.encode(), rank, ps_wire.TAG_REQUEST, self.groups[s])
            self._push_ops.append(op)

    def push(self, clock: int, grads: list[torch.Tensor]) -> None:
        """Send the gradient of clock ``clock`` (one flat buffer per server), then its CLOCK."""
        for s in range(len(self.servers)):
            for k, (start, stop) in enumerate(self.layout.spans(s)):
                self.post_chunk(clock, s, k, grads[s][start:stop])
        self.end_push(clock)

    def join(self) -> int:
        """Join a running job; return the clock to start at (see [Note: membership])."""
        wires, ops = self._post_acks()
        self._send_all(Op.JOIN, 0)
        self._wait_replies(ops, f"worker {self.worker}'s join")
        starts = self._check_acks(wires)
        start = max(starts)
        # Servers that admitted us at a lower clock see empty clocks up to the common start.
        for s, rank in enumerate(self.servers):
            for clock in range(starts[s], start):
                msg = self._header(Op.CLOCK, clock, s).encode()
                ps_wire.wait_all([ps_wire.post_send(msg, rank, ps_wire.TAG_REQUEST)])
        return start

    def leave(self, clock: int) -> list[Any] | None:
        """Leave the job. The coordinator (rank 0) first posts the receives of the final
        shards, which the servers send once every worker has left; `final_params` waits."""
        posted = self._post_params() if self.worker == 0 else None
        local = posted[0][self.local_shard] if posted is not None and self.local else None
        self._send_all(Op.LEAVE, clock, local)
        return list(posted) if posted is not None else None

    def final_params(self, posted: list[Any]) -> list[torch.Tensor]:
        """Coordinator only: every server's final shard, then stop the servers."""
        flats, wires, ops = posted
        self._wait_replies(ops, "the final weights")
        self._check_params(flats, wires)
        if self.local is not None:
            self._decode(self.local.reply(), {Op.PARAMS})
        self._send_all(Op.SHUTDOWN, 0)
        return flats


class PostedPull:
    """A pull whose receives and PULL messages are posted; `granted` waits for the ACKs."""

    def __init__(
        self,
        client: WorkerClient,
        clock: int,
        wires: list[torch.Tensor],
        ack_ops: list[Any],
        chunks: tuple[list[torch.Tensor], list[tuple[int, int, torch.Tensor]], list[Any]],
        sends: list[Any],
    ) -> None:
        self.client, self.clock, self.wires, self.ack_ops = client, clock, wires, ack_ops
        self.chunks, self.sends = chunks, sends

    def granted(self, wait_acks: bool = True) -> PendingPull:
        """Wait until every server has granted the pull (ACK); its chunks may still be on
        the wire (`PendingPull`). ``wait_acks=False``: return at once; the ACKs are waited
        for and checked with the first chunk, before any chunk is used (sync mode only: a
        dropped worker's SHUTDOWN reply has no chunks to wait with)."""
        client = self.client
        what = f"worker {client.worker}'s pull of step {self.clock + 1}"
        ps_wire.wait_all(self.sends)
        flats, chunk_wires, chunk_ops = self.chunks
        pending = PendingPull(
            client, flats, chunk_wires, chunk_ops, what, (self.wires, self.ack_ops)
        )
        if wait_acks:
            pending.take_acks()
        return pending


class PendingPull:
    """A granted pull whose chunks are still arriving; each is validated before it is used.

    ``flats``: each server's (P_s,) shard, filled chunk by chunk; ``floors``: the ACKs'
    clocks. The receives were posted in chunk order per server, as the server sends them.
    ``acks``: the ACKs' header buffers and receives, waited for by `take_acks` (or with the
    first chunk) and checked before any chunk is used.
    """

    def __init__(
        self,
        client: WorkerClient,
        flats: list[torch.Tensor],
        wires: list[tuple[int, int, torch.Tensor]],
        ops: list[Any],
        what: str,
        acks: tuple[list[torch.Tensor], list[Any]],
    ) -> None:
        self.client, self.flats, self.what = client, flats, what
        self.acks: tuple[list[torch.Tensor], list[Any]] | None = acks
        self._floors: list[int] = []
        # _post_params posts (header, payload) per chunk, in the order of ``wires``.
        self.ops = {(s, k): ops[2 * i : 2 * i + 2] for i, (s, k, _) in enumerate(wires)}
        self.wires = {(s, k): wire for s, k, wire in wires}
        # The local server's shard (if any) was copied in before its ACK.
        self.arrived = (
            {(client.local_shard, k) for k in range(len(client.layout.spans(client.local_shard)))}
            if client.local is not None
            else set()
        )

    @property
    def floors(self) -> list[int]:
        """The slowest worker's clock each server saw when it granted (waits for the ACKs)."""
        self.take_acks()
        return self._floors

    def take_acks(self, first: tuple[int, int] | None = None) -> None:
        """Wait for every server's ACK and check it; chunk ``first``'s receives are waited
        for in the same watched wait (one wait, not two, before forward can start), then
        validated after the ACKs."""
        if self.acks is None:
            return
        wires, ack_ops = self.acks
        chunk = first is not None and first not in self.arrived
        ops = ack_ops + (self.ops[first] if first is not None and chunk else [])
        self.client._wait_replies(ops, self.what)
        self.client._local_reply(wires)
        self._floors = self.client._check_acks(wires)
        self.acks = None
        if first is not None and chunk:
            s, k = first
            self.client.check_chunk(s, k, self.wires[first], self.flats[s].element_size())
            self.arrived.add(first)

    def wait_chunk(self, s: int, k: int) -> torch.Tensor:
        """Wait for chunk ``k`` of server ``s`` (validated); return server ``s``'s flat."""
        self.take_acks((s, k))
        if (s, k) not in self.arrived:
            rank = self.client.servers[s]
            ops = self.ops[(s, k)]
            ps_wire.wait_all_watched(
                ops, rank, self.client.names[s], self.client.reply_timeout_s, self.what
            )
            self.client.check_chunk(s, k, self.wires[(s, k)], self.flats[s].element_size())
            self.arrived.add((s, k))
        return self.flats[s]

    def wait_rest(self) -> None:
        """Wait for every chunk not yet in: one watched wait per server."""
        self.take_acks()
        for s, rank in enumerate(self.client.servers):
            keys = [key for key in self.ops if key[0] == s and key not in self.arrived]
            if not keys:
                continue
            ops = [op for key in keys for op in self.ops[key]]
            ps_wire.wait_all_watched(
                ops, rank, self.client.names[s], self.client.reply_timeout_s, self.what
            )
            for key in keys:
                self.client.check_chunk(*key, self.wires[key], self.flats[s].element_size())
                self.arrived.add(key)

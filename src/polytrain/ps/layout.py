"""Where each parameter lives on the wire: server shards as flat buffers cut into chunks.

Every rank builds the same `ShardLayout` from the same model ([Note: determinism] in
`polytrain.ps.sharding`): server ``s`` holds the parameters `plan_shards` gives it, concatenated
in model order into one flat buffer, and pushes and pulls move that buffer in chunks of
``ps.chunk_kb`` (the last chunk may be shorter; 0 picks it with `auto_chunk_bytes`). Shapes:
P = elements of one shard.

[Note: automatic chunk size] A chunk costs a fixed per-message price (a header, a gloo
isend/irecv pair, the receiver thread's Python, a forward pre-hook's wait) plus its bytes at the
link's rate; more chunks let a push leave during backward and a pull feed forward sooner
([Note: prioritised overlap] in `polytrain.ps.overlap`), fewer pay the fixed price less often.
Measured (2-core VM, quiet, `benchmarks/parameter_server/speed.py --sweep`, 2 workers + 1
server, sync, overlap on): the default job's 3.3 MB shard stepped in 105 ms as one chunk against
115-125 ms in 1 MiB or 0.8 MB chunks; the 11M GPT's 43 MB shard in 1.045 s in 10.7 MB chunks,
1.08 s in 4 MiB, 1.11 s in 1 MiB, 1.28 s in 256 KiB. On loopback the fixed price outweighs the
overlap at every size we measured, so the chunk is as large as the link still rewards: the
fixed rule takes the whole shard up to 4 MiB (where raw chunked gloo p2p stopped getting faster
on the VM: 0.41 GB/s in 64 KiB chunks, 0.98 in 256 KiB, 1.78 in 1 MiB, 1.34 in 4 MiB, 1.06 in
16 MiB, at load ~40), and 4 MiB chunks of a larger shard. (Until 2026-11-25 the rule kept at
least four to eight chunks per shard for the overlap's sake: 10% slower on the default job.)

[Note: chunk size from the link] With ``ps.chunk_kb = 0`` the job measures its own link at
start-up: rank 0 and a server on another rank time round trips of 16 KiB to 16 MiB messages
(`comm.ps_wire.probe_link`, stopping early on a slow link) and rank 0 broadcasts the points, so
every rank computes the same chunk size (it is part of the job fingerprint). A chunk also
costs the runtime its own price, which the raw probe does not see (`LINK_CHUNK_COST_S`, ~1 ms:
a header, thread hand-offs, a hook's wait; the loopback sweep's slope was 1.5-2.7 ms per chunk
over two workers and both directions), so a size's rate is its bytes over its measured time
plus that price. The chunk (`link_chunk_bytes`) is, among the measured sizes whose rate reaches
90% of the best, the smallest whose transfer takes at least `LINK_CHUNK_MIN_S` (5 ms), else the
largest of them; at most the largest shard and at least `LINK_CHUNK_MIN`. On loopback (~3 GB/s)
no chunk short of 16 MiB takes 5 ms, so a shard goes whole or in 16 MiB pieces, the sweep's
best; over a rate-limited link (200 Mbit/s: 25 MB/s) a 256 KiB chunk already takes 10 ms, so a
shard goes in many chunks that leave during backward. (Taking the smallest size within 90% of
the best raw rate alone flipped between 1 MiB and 4 MiB on loopback from one probe to the next;
with the time floor but raw rates, 1 MiB still won a busy probe in 4 of 14 runs on
2026-11-25, since 1 MiB streams out of cache up to 2x faster than 4 MiB on loopback, and those
runs stepped 10-20% slower than with the whole shard; the runtime's price per chunk
outweighs that.) Until
2026-11-25 the points came from `polytrain calibrate`'s saved loopback curve, which cannot see a
slower link between hosts: over an emulated 200 Mbit/s link the colocated default job stepped
1.06x all-reduce's time with one chunk per shard, against 0.78x in the measured link's 256 KiB
chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from polytrain.errors import ConfigError
from polytrain.ps.protocol import chunk_spans, dtype_code, job_fingerprint
from polytrain.ps.sharding import ShardPlan, plan_shards

__all__ = [
    "AUTO_CHUNK_MAX",
    "AUTO_CHUNK_MIN",
    "LINK_CHUNK_MIN",
    "ShardLayout",
    "auto_chunk_bytes",
    "build_layout",
    "link_chunk_bytes",
]

AUTO_CHUNK_MIN = 1 << 20
"""Smallest automatic chunk in bytes ([Note: automatic chunk size])."""
AUTO_CHUNK_MAX = 4 << 20
"""Largest automatic chunk in bytes."""


LINK_CHUNK_MIN = 256 << 10
"""Smallest chunk chosen from the measured link ([Note: chunk size from the link]): a chunk also
costs the PS runtime ~1 ms of Python and thread hand-offs that the raw probe does not see; over
the emulated 200 Mbit/s link the colocated default job stepped 0.90x all-reduce's time in
64 KiB chunks and 0.78x in 256 KiB ones."""
LINK_CHUNK_EFFICIENCY = 0.9
LINK_CHUNK_COST_S = 1e-3
"""The PS runtime's own price per chunk, beside its transfer ([Note: chunk size from the link]):
a header, thread hand-offs, a hook's wait (the loopback sweep's slope: 1.5-2.7 ms per chunk
over two workers and both directions)."""
LINK_CHUNK_MIN_S = 5e-3
"""Shortest transfer time of an automatic chunk on its link ([Note: chunk size from the
link]): the runtime's ~1 ms per chunk stays a fifth of it or less."""


def auto_chunk_bytes(shard_bytes: int) -> int:
    """Chunk size for shards of at most ``shard_bytes`` ([Note: automatic chunk size]): the
    whole shard up to `AUTO_CHUNK_MAX` (at least `AUTO_CHUNK_MIN`)."""
    return min(max(shard_bytes, AUTO_CHUNK_MIN), AUTO_CHUNK_MAX)


def link_chunk_bytes(points: Sequence[tuple[float, float]], shard_bytes: int) -> int | None:
    """Chunk size from a measured p2p curve of ``(bytes, seconds)`` points ([Note: chunk size
    from the link]); None when the curve cannot tell (fewer than two usable points)."""
    curve = sorted((b, t) for b, t in points if b > 0 and t > 0)
    if len(curve) < 2:
        return None
    # a chunk's rate in the runtime: its transfer plus the runtime's own price per chunk
    rate = {b: b / (t + LINK_CHUNK_COST_S) for b, t in curve}
    best = max(rate.values())
    efficient = [(b, t) for b, t in curve if rate[b] >= LINK_CHUNK_EFFICIENCY * best]
    long_enough = [b for b, t in efficient if t >= LINK_CHUNK_MIN_S]
    chosen = long_enough[0] if long_enough else efficient[-1][0]
    return int(max(min(chosen, shard_bytes), LINK_CHUNK_MIN))


@dataclass(frozen=True)
class ShardLayout:
    """Server shards of one model: names, shapes, flat sizes and chunk spans per server."""

    plan: ShardPlan
    names: tuple[tuple[str, ...], ...]  # per server, in model order
    shapes: dict[str, torch.Size]
    dtype: torch.dtype
    chunk_elems: int
    job_id: int

    @property
    def num_servers(self) -> int:
        return len(self.names)

    def numel(self, server: int) -> int:
        """P: elements of server ``server``'s flat buffer."""
        return sum(self.shapes[n].numel() for n in self.names[server])

    def spans(self, server: int) -> list[tuple[int, int]]:
        """``(start, stop)`` of each chunk of server ``server``'s flat buffer."""
        return chunk_spans(self.numel(server), self.chunk_elems)

    @property
    def dtype_code(self) -> int:
        return dtype_code(self.dtype)

    def flatten(self, tensors: dict[str, torch.Tensor], server: int) -> torch.Tensor:
        """Server ``server``'s tensors concatenated into one flat (P,) buffer."""
        return torch.cat([tensors[n].detach().reshape(-1) for n in self.names[server]])

    def unflatten(self, flat: torch.Tensor, server: int) -> dict[str, torch.Tensor]:
        """Views of a flat (P,) buffer, one per parameter of ``server``, shaped like it."""
        out: dict[str, torch.Tensor] = {}
        start = 0
        for name in self.names[server]:
            shape = self.shapes[name]
            out[name] = flat[start : start + shape.numel()].view(shape)
            start += shape.numel()
        return out


def build_layout(
    model: nn.Module,
    num_servers: int,
    chunk_kb: int,
    extra: str = "",
    link: Sequence[tuple[float, float]] = (),
) -> ShardLayout:
    """The shard layout of ``model``'s trainable parameters over ``num_servers`` servers;
    ``link``: the calibrated p2p curve, if any (used when ``chunk_kb`` is 0)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    dtypes = {p.dtype for _, p in params}
    if len(dtypes) != 1:
        raise ConfigError(
            f"parameter-server training needs one parameter dtype, the model has "
            f"{sorted(str(d) for d in dtypes)}: cast the model to one dtype"
        )
    (dtype,) = dtypes
    plan = plan_shards([(n, p.numel() * p.element_size()) for n, p in params], num_servers)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if chunk_kb == 0:
        largest = max(plan.server_bytes)
        chunk_bytes = link_chunk_bytes(link, largest) or auto_chunk_bytes(largest)
    else:
        chunk_bytes = chunk_kb * 1024
    chunk_elems = max(1, chunk_bytes // itemsize)
    shapes = {n: p.shape for n, p in params}
    job_id = job_fingerprint(
        [(n, tuple(p.shape), str(p.dtype)) for n, p in params],
        extra=f"servers={num_servers};chunk_elems={chunk_elems};{extra}",
    )
    return ShardLayout(plan, plan.assignment, shapes, dtype, chunk_elems, job_id)

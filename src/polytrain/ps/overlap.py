"""Overlap of a sync parameter-server step with its compute: push from backward, pull into forward.

[Note: prioritised overlap] (ByteScheduler, Peng et al., SOSP 2019; P3, Jayarajan et al.,
SysML 2019) A worker's gradient is not pushed as one block after backward: every parameter
has a post-accumulate-grad hook, which copies its gradient into its place in its server's flat
push buffer, and the moment the last parameter overlapping a chunk of that buffer has its
gradient, the chunk is posted (`GradPusher`). Backward produces the last layers first, so their
chunks go first and the push overlaps the rest of backward. The next step's pull is granted
as before, but the worker does not wait for every chunk: each module with parameters of its
own has a forward pre-hook that waits only for the chunks holding those parameters and copies
them in (`ParamFetcher`); servers send their chunks in model order, so the first layers arrive
first and forward starts while later chunks are still on the wire.

Parity: the bytes pushed are exactly the gradient the unoverlapped push sends (the same flat
layout, the same chunks; a chunk is posted only once every parameter in it is final), and a
parameter is used only after its chunks are in, so sync stays bit-identical to the plain push.
Limits: sync mode only (async and ssp clip each worker's gradient before its push, which needs
the whole gradient) and not hierarchical (the host reduces the whole gradient first); with
``train.grad_accum > 1`` only the last micro-batch's backward pushes. Shapes: P_s = elements of
server s's shard.

[Note: pull with the clock] (issue 14: the step's exposed tail) A worker ends its push as soon
as backward has ended, before the loss all-reduce: it posts the CLOCK, so the server makes the
update while the workers reduce their losses instead of after. Right after the all-reduce it
posts the pull of the next step (every receive first, [Note: replies never wait] in
polytrain.ps.server) before it waits for its chunk sends and leaves the step; the server defers
that pull as before and grants it the moment the update is made, so the grant and the first
chunks travel while the worker is between steps, and the next step no longer starts with a
PULL -> grant round trip. The CLOCK can precede the all-reduce, which decides whether the step
is non-finite, because the push is poisoned from what the worker knows itself: a worker whose
own loss or gradient is non-finite (`GradPusher.finite`) re-sends every chunk filled with NaN
before its CLOCK, so a step that the all-reduce finds non-finite on any worker reaches every
server as a NaN sum, which every server drops or stops on ([Note: parameter-server NaN] in
polytrain.ps.strategy), as the workers decide from the all-reduce. A finite step's bytes are
unchanged, so sync parity stays exact. No pull is posted after the last step or before a stop
on a non-finite step; a posted pull that no step takes is taken by the evaluation after it, or
waited for before the worker leaves. An async or ssp worker (no overlap: its push is whole and
blocking) posts its next pull right after its push too (2026-11-25), so the PULL's trip and the
server's grant travel while the worker is between steps; the server grants it by the same
rule as a later one (async at once, ssp within the staleness bound), so the parameters it
returns may miss pushes that arrive in between, which is what async allows and what the
pull's floors report.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from polytrain.core.step import all_finite
from polytrain.ps.layout import ShardLayout

__all__ = ["ChunkKey", "GradPusher", "ParamFetcher", "chunk_members", "param_chunks"]

ChunkKey = tuple[int, int]
"""(server, chunk index) of one chunk of one server's flat shard."""


def param_chunks(layout: ShardLayout) -> dict[str, tuple[int, int, int, list[ChunkKey]]]:
    """For each parameter name: (server, start, stop) in that server's flat buffer and the
    chunks its elements fall into, in order."""
    out: dict[str, tuple[int, int, int, list[ChunkKey]]] = {}
    for s in range(layout.num_servers):
        spans = layout.spans(s)
        start = 0
        for name in layout.names[s]:
            stop = start + layout.shapes[name].numel()
            first, last = start // layout.chunk_elems, (stop - 1) // layout.chunk_elems
            keys = [(s, k) for k in range(first, last + 1)] if stop > start else []
            assert last < len(spans) or stop == start
            out[name] = (s, start, stop, keys)
            start = stop
    return out


def chunk_members(layout: ShardLayout) -> dict[ChunkKey, list[str]]:
    """For each chunk: the parameters with at least one element in it (in model order)."""
    members: dict[ChunkKey, list[str]] = {
        (s, k): [] for s in range(layout.num_servers) for k in range(len(layout.spans(s)))
    }
    for name, (_, _, _, keys) in param_chunks(layout).items():
        for key in keys:
            members[key].append(name)
    return members


PostChunk = Callable[[int, int, torch.Tensor], None]
"""Post chunk ``k`` of server ``s``'s push (a view of its flat buffer): (s, k, payload)."""


class GradPusher:
    """Posts a step's gradient chunk by chunk as backward produces it ([Note: prioritised
    overlap]). `arm` before the backward that completes the gradient, `flush` after it."""

    def __init__(self, model: nn.Module, layout: ShardLayout) -> None:
        self.layout = layout
        self.where = param_chunks(layout)
        self.members = chunk_members(layout)
        self.flats = [
            torch.empty(layout.numel(s), dtype=layout.dtype) for s in range(len(layout.names))
        ]
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.pending: dict[ChunkKey, int] = {}
        self.done: set[str] = set()
        self.order: list[ChunkKey] = []  # chunks in the order they were posted (this step)
        self.early = 0  # chunks posted from inside backward (this step)
        self.post: PostChunk | None = None
        self.handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(n)) for n, p in self.params.items()
        ]

    def _make_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if self.post is not None and name not in self.done:
                self._ready(name, param.grad)
                self.early = len(self.order)

        return hook

    def arm(self, post: PostChunk) -> None:
        """The next backward's gradients are final: post each chunk once it is complete."""
        self.post = post
        self.pending = {key: len(names) for key, names in self.members.items()}
        self.done = set()
        self.order = []
        self.early = 0

    def _ready(self, name: str, grad: torch.Tensor | None) -> None:
        s, start, stop, keys = self.where[name]
        view = self.flats[s][start:stop]
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad.detach().reshape(-1))
        self.done.add(name)
        assert self.post is not None
        for key in keys:
            self.pending[key] -= 1
            if self.pending[key] == 0:
                self._post(key)

    def _post(self, key: ChunkKey) -> None:
        s, k = key
        start, stop = self.layout.spans(s)[k]
        assert self.post is not None
        self.post(s, k, self.flats[s][start:stop])
        self.order.append(key)

    def flush(self) -> None:
        """After the last backward: complete every chunk still pending (parameters without a
        gradient push zeros, as the unoverlapped push does) and disarm."""
        for name, param in self.params.items():
            if name not in self.done:
                self._ready(name, param.grad)
        self.post = None

    def finite(self, loss: torch.Tensor) -> bool:
        """Whether ``loss`` and every element of this step's pushed gradient are finite."""
        return bool(torch.isfinite(loss.detach()).all()) and all(map(all_finite, self.flats))

    def repost(self, post: PostChunk, fill: float) -> None:
        """Post every chunk again filled with ``fill`` (a dropped step's NaN push, [Note:
        parameter-server NaN]); the caller has waited for the first sends."""
        for flat in self.flats:
            flat.fill_(fill)
        for s in range(len(self.flats)):
            for k, (start, stop) in enumerate(self.layout.spans(s)):
                post(s, k, self.flats[s][start:stop])


WaitChunk = Callable[[int, int], torch.Tensor]
"""Wait for chunk ``k`` of server ``s``'s pulled shard; return that server's flat buffer."""


class ParamFetcher:
    """Copies pulled parameters into the replica as forward reaches them ([Note: prioritised
    overlap]): a forward pre-hook per module that owns parameters waits for their chunks."""

    def __init__(self, model: nn.Module, layout: ShardLayout) -> None:
        self.where = param_chunks(layout)
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        by_id = {id(p): n for n, p in self.params.items()}
        self.wait: WaitChunk | None = None
        self.fresh: set[str] = set()
        self.chunks_in: set[ChunkKey] = set()
        self.wait_s = 0.0
        self.handles: list[Any] = []
        for module in model.modules():
            own = [by_id[id(p)] for p in module.parameters(recurse=False) if id(p) in by_id]
            if own:
                self.handles.append(module.register_forward_pre_hook(self._make_hook(own)))

    def _make_hook(self, names: list[str]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self.wait is not None:
                for name in names:
                    self._fetch(name)

        return hook

    def start(self, wait: WaitChunk) -> None:
        """A pull was granted; its chunks arrive through ``wait``."""
        self.wait = wait
        self.fresh = set()
        self.chunks_in = set()
        self.wait_s = 0.0

    @torch.no_grad()
    def _fetch(self, name: str) -> None:
        if name in self.fresh:
            return
        assert self.wait is not None
        _, start, stop, keys = self.where[name]
        if not keys:  # an empty parameter
            self.fresh.add(name)
            return
        flat: torch.Tensor | None = None
        t0 = time.perf_counter()
        for key in keys:
            flat = self.wait(*key)
            self.chunks_in.add(key)
        self.wait_s += time.perf_counter() - t0
        assert flat is not None
        param = self.params[name]
        param.copy_(flat[start:stop].view(param.shape))
        self.fresh.add(name)

    def finish(self) -> None:
        """Fetch every parameter forward did not reach; nothing is pending afterwards."""
        if self.wait is None:
            return
        for name in self.params:
            self._fetch(name)
        self.wait = None

    @property
    def pending(self) -> bool:
        return self.wait is not None

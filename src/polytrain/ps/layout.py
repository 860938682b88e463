"""Where each parameter lives on the wire: server shards as flat buffers cut into chunks.

Every rank builds the same `ShardLayout` from the same model ([Note: determinism] in
`polytrain.ps.sharding`): server ``s`` holds the parameters `plan_shards` gives it, concatenated
in model order into one flat buffer, and pushes and pulls move that buffer in chunks of
``ps.chunk_kb`` (the last chunk may be shorter). Shapes: P = elements of one shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from polytrain.errors import ConfigError
from polytrain.ps.protocol import chunk_spans, dtype_code, job_fingerprint
from polytrain.ps.sharding import ShardPlan, plan_shards

__all__ = ["ShardLayout", "build_layout"]


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


def build_layout(model: nn.Module, num_servers: int, chunk_kb: int, extra: str = "") -> ShardLayout:
    """The shard layout of ``model``'s trainable parameters over ``num_servers`` servers."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    dtypes = {p.dtype for _, p in params}
    if len(dtypes) != 1:
        raise ConfigError(
            f"parameter-server training needs one parameter dtype, the model has "
            f"{sorted(str(d) for d in dtypes)}: cast the model to one dtype"
        )
    (dtype,) = dtypes
    plan = plan_shards([(n, p.numel() * p.element_size()) for n, p in params], num_servers)
    chunk_elems = max(1, chunk_kb * 1024 // torch.empty((), dtype=dtype).element_size())
    shapes = {n: p.shape for n, p in params}
    job_id = job_fingerprint(
        [(n, tuple(p.shape), str(p.dtype)) for n, p in params],
        extra=f"servers={num_servers};chunk_elems={chunk_elems};{extra}",
    )
    return ShardLayout(plan, plan.assignment, shapes, dtype, chunk_elems, job_id)

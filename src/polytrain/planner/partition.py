"""Stages for the cost model: the runtime's own partition search, fed from `BlockStats`.

`pipeline.partition.search_partition` is the dynamic program that ``pipeline.partition =
"auto"`` runs on measured block profiles (PipeDream's planner: the fastest slowest stage, ties
to the most even split). The planner runs the same search on profiles derived from FLOPs, so it
prices the split the runtime would choose from a perfect profile. Pure, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

from polytrain.errors import PlanError
from polytrain.pipeline.partition import BlockProfile, search_partition
from polytrain.planner.types import BlockStats

__all__ = ["balanced_stages"]


def balanced_stages(blocks: Sequence[BlockStats], num_stages: int) -> list[list[BlockStats]]:
    """Split ``blocks`` into ``num_stages`` contiguous non-empty stages, slowest stage fastest."""
    if num_stages > len(blocks):
        raise PlanError(
            f"{num_stages} pipeline stages for a model of {len(blocks)} blocks: use at most "
            f"{len(blocks)}"
        )
    return [list(stage) for stage in _split(tuple(blocks), num_stages)]


@cache
def _split(blocks: tuple[BlockStats, ...], num_stages: int) -> tuple[tuple[BlockStats, ...], ...]:
    # cached: the search asks for the same model's split once per layout
    if num_stages == 1:
        return (blocks,)
    total_flops = sum(b.fwd_flops for b in blocks) or 1.0
    total_bytes = sum(b.param_bytes for b in blocks) or 1.0
    profiles = []
    for b in blocks:
        # relative time: FLOPs, plus a little for parameter bytes so that FLOP-free blocks
        # (embeddings) still weigh something, as their optimizer update and memory traffic do
        t = b.fwd_flops / total_flops + 1e-3 * b.param_bytes / total_bytes
        profiles.append(
            BlockProfile(
                forward_s=t,
                backward_s=2 * t,
                param_count=b.params,
                param_bytes=b.param_bytes,
                grad_bytes=b.param_bytes,
                optimizer_bytes=0,
                activation_bytes=int(b.saved_bytes),
                input_bytes=0,
                output_bytes=int(b.output_bytes),
            )
        )
    result = search_partition(
        profiles,
        num_stages,
        schedule="1f1b",
        num_microbatches=num_stages,
        memory_limit_bytes=None,
    )
    stages: list[tuple[BlockStats, ...]] = []
    start = 0
    for count in result.counts:
        stages.append(blocks[start : start + count])
        start += count
    return tuple(stages)

"""Balanced contiguous stages for the cost model (pure).

The runtime's ``pipeline.partition = "auto"`` balances measured stage times; the planner
balances forward FLOPs (parameter bytes break ties for zero-FLOP blocks such as embeddings),
minimizing the largest stage: the linear-partition dynamic program (as PipeDream's planner).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

from polytrain.errors import PlanError
from polytrain.planner.types import BlockStats

__all__ = ["balanced_stages"]


def balanced_stages(blocks: Sequence[BlockStats], num_stages: int) -> list[list[BlockStats]]:
    """Split ``blocks`` into ``num_stages`` non-empty runs minimizing the largest run's cost."""
    return [list(stage) for stage in _balanced(tuple(blocks), num_stages)]


@cache
def _balanced(
    blocks: tuple[BlockStats, ...], num_stages: int
) -> tuple[tuple[BlockStats, ...], ...]:
    # cached: the search asks for the same model's split once per layout
    n = len(blocks)
    if num_stages > n:
        raise PlanError(f"{num_stages} pipeline stages for a model of {n} blocks: use at most {n}")
    if num_stages == 1:
        return (blocks,)
    total_flops = sum(b.fwd_flops for b in blocks) or 1.0
    total_bytes = sum(b.param_bytes for b in blocks) or 1.0
    cost = [b.fwd_flops / total_flops + 1e-3 * b.param_bytes / total_bytes for b in blocks]
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)

    @cache
    def best(i: int, k: int) -> tuple[float, int]:
        """(max stage cost, end of the first stage) for blocks[i:] in k stages."""
        if k == 1:
            return prefix[n] - prefix[i], n
        out = (float("inf"), i + 1)
        for j in range(i + 1, n - k + 2):
            first = prefix[j] - prefix[i]
            if first >= out[0]:
                break
            rest = best(j, k - 1)[0]
            out = min(out, (max(first, rest), j))
        return out

    stages: list[tuple[BlockStats, ...]] = []
    i = 0
    for k in range(num_stages, 0, -1):
        j = best(i, k)[1]
        stages.append(blocks[i:j])
        i = j
    return tuple(stages)

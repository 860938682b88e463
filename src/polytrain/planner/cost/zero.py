"""ZeRO-2 / ZeRO-3 through FSDP2: per-block all-gather (prefetched) and reduce-scatter.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
SC20; FSDP: Zhao et al., VLDB 2023. FSDP2 (``fully_shard``) shards each block's parameters
over the dp ranks. ZeRO-3 (``reshard_after_forward=True``) all-gathers a block before its
forward and again before its backward, and reduce-scatters its gradient after the backward:
1.5x the bytes of DDP's all-reduce. ZeRO-2 (``reshard_after_forward=False``) keeps the gathered
parameters from forward to backward: one all-gather and one reduce-scatter, DDP's volume.
Derivation: docs/planner.md "ZeRO".
"""

from __future__ import annotations

from collections.abc import Sequence

from polytrain.planner.cost.common import Env
from polytrain.planner.cost.overlap import overlap

__all__ = ["zero_step"]


def zero_step(
    env: Env,
    stage: int,
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    param_bytes: Sequence[float],
    dp: int,
    stride: int,
    *,
    scatter: bool = True,
) -> tuple[float, float, float]:
    """(forward end, backward end, exposed communication) of one micro-step, blocks in forward
    order; ``param_bytes[k]`` is block ``k``'s unsharded size on this rank (already / tp).

    ``scatter=False``: an accumulation micro-step before the last, where the strategy turns
    gradient sync off (``set_requires_gradient_sync(False)``): gathers, no reduce-scatter."""
    gather = [env.collective_s("all_gather", b, dp, stride) for b in param_bytes]
    scatter_s = [
        env.collective_s("reduce_scatter", b, dp, stride) if scatter else 0.0 for b in param_bytes
    ]
    f_end, f_exposed = overlap(list(fwd_s), before=gather)
    rev = list(reversed(range(len(bwd_s))))
    b_before = [gather[k] for k in rev] if stage == 3 else None
    b_end, b_exposed = overlap(
        [bwd_s[k] for k in rev], before=b_before, after=[scatter_s[k] for k in rev]
    )
    return f_end, b_end, f_exposed + b_exposed

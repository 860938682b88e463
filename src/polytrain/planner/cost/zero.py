"""ZeRO-2 / ZeRO-3 through FSDP2: per-block all-gather (prefetched) and reduce-scatter.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
SC20; FSDP: Zhao et al., VLDB 2023. FSDP2 (``fully_shard``) shards each block's parameters
over the dp ranks. ZeRO-3 (``reshard_after_forward=True``) all-gathers a block before its
forward and again before its backward, and reduce-scatters its gradient after the backward:
1.5x the bytes of DDP's all-reduce. ZeRO-2 (``reshard_after_forward=False``) keeps the gathered
parameters from forward to backward: one all-gather and one reduce-scatter, DDP's volume.
Derivation: docs/planner.md "ZeRO".

[Note: FSDP2 on a CPU host] On an accelerator FSDP2 issues its all-gathers and reduce-scatters
on side streams while the host runs ahead, so they overlap compute (prefetch depth one,
[Note: two-stream overlap]). On a CPU host there is no stream and no running ahead: FSDP2
calls ``all_gather_single`` and ``reduce_scatter_single`` with ``async_op=False`` (torch
``_fully_shard/_fsdp_param_group.py`` ``unshard``: ``unshard_async_op`` is False;
``_fsdp_collectives.py`` ``foreach_reduce``), so each blocks the one thread that computes: a
block's gather waits in its pre-forward (and, for ZeRO-3, pre-backward) hook, its reduce-scatter
in its post-backward hook, and its backward prefetch is as synchronous. Every collective is
then exposed, in series with the compute; measured on this host (2026-11-25, gpt tiny, 7 units
over gloo): forward 33 -> 55 ms and backward 62 -> 85 ms from dp2 to dp2-zero2, where the
compute is the same.
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
    if env.cluster.device.key == "cpu":  # [Note: FSDP2 on a CPU host]: nothing overlaps
        # inside a step a unit's collectives cost what the two-rank probe measured ([Note:
        # FSDP2 collectives in a step]), shared between them as the isolated curves share it
        for k, b in enumerate(param_bytes):
            in_step = env.fsdp_in_step_s(stage, b, dp, stride)
            rs = scatter_s[k] if scatter else env.collective_s("reduce_scatter", b, dp, stride)
            isolated = gather[k] * (2 if stage == 3 else 1) + rs
            if in_step is not None and isolated > 0:
                factor = in_step / isolated
                gather[k] *= factor
                scatter_s[k] *= factor
        f_comm = sum(gather)
        b_comm = sum(scatter_s) + (sum(gather) if stage == 3 else 0.0)
        return sum(fwd_s) + f_comm, sum(bwd_s) + b_comm, f_comm + b_comm
    f_end, f_exposed = overlap(list(fwd_s), before=gather)
    rev = list(reversed(range(len(bwd_s))))
    b_before = [gather[k] for k in rev] if stage == 3 else None
    b_end, b_exposed = overlap(
        [bwd_s[k] for k in rev], before=b_before, after=[scatter_s[k] for k in rev]
    )
    return f_end, b_end, f_exposed + b_exposed

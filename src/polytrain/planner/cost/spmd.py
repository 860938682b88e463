"""SPMD layouts: dp x tp (with ZeRO, recomputation, late multiply) in one step, no pipeline.

The order is the runtime's (STYLE 3: tensor parallel -> recompute -> data parallel): each
block's compute is split tp ways and pays its tensor-parallel collectives, recomputation adds
one forward to each backward, and data parallel (DDP, ZeRO through FSDP2, or FSDP2's replicate
for dp x tp) combines the replicas. Mesh groups are placed as `topology.ParallelDims` lays ranks
out (``pp, dp, tp``, tp fastest), which decides whether a group crosses hosts. Derivation:
docs/planner.md "Hybrids". Priced for the `parallel` family (its registry row names this
module).
"""

from __future__ import annotations

from collections.abc import Sequence

from polytrain.planner.cost.common import Env, Shape
from polytrain.planner.cost.dp import bucket_sizes, dp_backward, replicate_backward
from polytrain.planner.cost.parts import (
    block_times,
    clips_shards,
    dtensor_mesh,
    end_of_step_s,
    loop_s,
)
from polytrain.planner.cost.sufficient_factor import sf_block_s
from polytrain.planner.cost.tp import tp_collectives
from polytrain.planner.cost.zero import zero_step
from polytrain.planner.types import Layout, ModelStats

__all__ = ["spmd_step"]


def spmd_step(
    layout: Layout, stats: ModelStats, env: Env, shape: Shape
) -> tuple[float, dict[str, float]]:
    """Step seconds and breakdown of an SPMD ``layout`` (pp = 1)."""
    mb_samples = shape.mb_samples
    blocks = stats.blocks
    n = len(blocks)
    fwd, bwd, tp_s = block_times(
        env,
        blocks,
        mb_samples,
        layout.tp,
        layout.recomputes,
        first=0,
        last=n - 1,
        ops=layout.recompute_ops,
    )
    share = _recomputed_share(stats, layout)
    if share < 1.0:  # the one block recomputes this share of its layers' forward
        _, plain, plain_tp = block_times(
            env, blocks, mb_samples, layout.tp, lambda _: False, first=0, last=n - 1
        )
        bwd = [p + share * (b - p) for p, b in zip(plain, bwd, strict=True)]
        tp_s = plain_tp + share * (tp_s - plain_tp)
    compute = (sum(fwd) + sum(bwd)) * layout.grad_accum
    tp_s *= layout.grad_accum
    grad_bytes = [b.bytes_per_tp_rank(layout.tp) for b in blocks]
    dp, stride = layout.dp, layout.tp
    units = n + 1  # FSDP2's: every block, then the root
    if layout.zero:
        z_fwd, z_bwd, z_bytes = fwd, bwd, grad_bytes
        if stats.fsdp_units:  # [Note: FSDP units of a user's model] in measure/layer_stats.py
            z_fwd, z_bwd, z_bytes = _fsdp_unit_split(stats, fwd, bwd, layout.tp)
            units = len(stats.fsdp_units)
        # FSDP2 gathers every micro-step; with accumulation it reduce-scatters on the last only
        f_end, b_end, exposed = zero_step(env, layout.zero, z_fwd, z_bwd, z_bytes, dp, stride)
        step = f_end + b_end
        if layout.grad_accum > 1:
            f0, b0, e0 = zero_step(
                env, layout.zero, z_fwd, z_bwd, z_bytes, dp, stride, scatter=False
            )
            step += (f0 + b0) * (layout.grad_accum - 1)
            exposed += e0 * (layout.grad_accum - 1)
    sf_s = 0.0
    if not layout.zero:
        if layout.sufficient_factor:
            pairs = [sf_block_s(env, b, mb_samples, dp, stats.dtype_bytes) for b in blocks]
            sf_s = sum(p[0] for p in pairs)
            grad_bytes = [p[1] / layout.tp for p in pairs]
        if dp > 1 and layout.tp > 1:  # FSDP2's replicate (parallel/family.py)
            b_end, exposed = replicate_backward(env, bwd, grad_bytes, dp, stride)
        else:
            b_end, exposed = dp_backward(env, bwd, grad_bytes, dp, stride)
        # no_sync micro-steps first, then the last one overlaps its all-reduce (DDP)
        step = (sum(fwd) + sum(bwd)) * (layout.grad_accum - 1) + sum(fwd) + b_end + sf_s
        exposed += sf_s
    opt = end_of_step_s(layout, stats, env, blocks)
    # FSDP2's hooks on every wrapped block and the root, once per micro-step: ZeRO-2/3, and
    # FSDP2's replicate for dp x tp (parallel/family.py: DDP cannot take DTensor parameters)
    fsdp_stage = layout.zero if layout.zero else (0 if dp > 1 and layout.tp > 1 else -1)
    tensors = sum(b.tensors for b in blocks)
    fsdp = env.fsdp_overhead_s(fsdp_stage, units, tensors) if fsdp_stage >= 0 else 0.0
    fsdp *= layout.grad_accum
    per_step, per_micro = loop_s(env)
    loop = per_step + per_micro * layout.grad_accum
    # every rank waits for every other each step (the collectives, the end of step's reduce):
    # for the stalls of the others' own work since ([Note: ranks' skew] in measure/contention.py)
    syncs = _syncs(layout, stats, env, grad_bytes)
    skew = env.skew_s(compute - tp_s + opt + fsdp + loop, dp * layout.tp, syncs)
    step += opt + fsdp + loop + skew
    return step, {
        "compute": compute - tp_s,
        "tp_comm": tp_s,
        "dp_comm": exposed,
        "bubble": 0.0,
        "optimizer": opt,
        "late_multiply": sf_s,
        "fsdp_hooks": fsdp,
        "loop": loop,
        "skew": skew,
    }


# [Note: synchronizations priced apart]
# The wait for the slowest rank at a synchronization ([Note: ranks' skew] in
# measure/contention.py) is in the price of the collectives whose figures were timed in a step,
# between compute: the end of step's [loss, flag] reduce (`reduce_in_step`) and FSDP2's
# gathers and reduce-scatters (`fsdp_in_step`). The others are priced without it, and
# `_syncs` counts them for `Env.skew_s`: DDP's bucket all-reduces and FSDP2's replicate's
# per-block ones (the isolated curves, timed from a barrier), tensor parallelism's collectives
# (`tp_in_step`: the slope over chained Linear pairs with next to no compute between them),
# and the DTensor clip's norm (`dtensor_clip_call_s`, timed from a barrier). A gradient
# accumulation's micro-steps repeat the tensor-parallel ones (and recomputation their
# forward's); DDP and replicate synchronize on the last micro-step only.
def _syncs(layout: Layout, stats: ModelStats, env: Env, grad_bytes: Sequence[float]) -> float:
    """Synchronizations a step of an SPMD ``layout`` makes at a price without the wait for the
    slowest rank ([Note: synchronizations priced apart])."""
    blocks, dp, tp = stats.blocks, layout.dp, layout.tp
    n = len(blocks)
    syncs = 0.0
    if dp > 1 and not layout.zero and not layout.sufficient_factor:
        if tp > 1:  # FSDP2's replicate: one all-reduce per block
            syncs += n
        else:  # DDP: one per bucket
            buckets = bucket_sizes(list(reversed(grad_bytes)), env.bucket_bytes)
            syncs += sum(count for per_block in buckets for count, _ in per_block)
    if tp > 1:
        # forward, backward, and for a recomputing block the forward's again
        per_micro = sum(
            tp_collectives(b, tp, first=k == 0, last=k == n - 1, backward=backward)
            for k, b in enumerate(blocks)
            for backward in ((False, True, False) if layout.recomputes(k) else (False, True))
        )
        syncs += per_micro * layout.grad_accum
    if clips_shards(layout, stats) and env.dtensor_clip_call_s(dtensor_mesh(layout, blocks)) > 0:
        syncs += 1
    return syncs


def _fsdp_unit_split(
    stats: ModelStats, fwd: Sequence[float], bwd: Sequence[float], tp: int
) -> tuple[list[float], list[float], list[float]]:
    """A one-block user model's forward and backward seconds and this rank's parameter bytes
    per FSDP2 unit (`ModelStats.fsdp_units`): the seconds in proportion to the units' bytes,
    the bytes at the block's tensor-parallel share."""
    whole = sum(b for b, _ in stats.fsdp_units) or 1.0
    share = [b / whole for b, _ in stats.fsdp_units]
    per_rank = sum(b.bytes_per_tp_rank(tp) for b in stats.blocks)
    return (
        [sum(fwd) * x for x in share],
        [sum(bwd) * x for x in share],
        [per_rank * x for x in share],
    )


def _recomputed_share(stats: ModelStats, layout: Layout) -> float:
    """Of a user's one-block model, the share of its repeated layers ``layout`` recomputes:
    the runtime recomputes per layer ([Note: recomputed layers of a user's model] in
    planner/memory.py), so ``every:K`` reruns one layer in K, not the whole model's forward
    (the one block's index 0 alone would say all). 1 for every other model and layout."""
    if not (layout.every_k and len(stats.blocks) == 1 and stats.layer_blocks):
        return 1.0
    layers = len(stats.layer_blocks)
    return sum(layout.recomputes(i) for i in range(layers)) / layers

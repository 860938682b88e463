"""The parts every layout's step is priced from, whatever its strategy family.

A block's forward and backward on a rank (its compute split tp ways, its tensor-parallel
collectives and DTensor dispatch), the end of a step (non-finite check, clip, update, and
`core.step.finish_step`'s small reductions), and the training loop's own Python. `cost.hybrid`
composes them for SPMD, parameter-server and decentralized layouts, `cost.stages` for
pipelines. Derivations: docs/planner.md "Compute", "Hybrids".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from polytrain.planner.cost.common import Env
from polytrain.planner.cost.tp import tp_comm_s, tp_dispatch_s
from polytrain.planner.recompute import rerun_block
from polytrain.planner.types import BACKWARD_FLOPS_PER_FORWARD, BlockStats, Layout, ModelStats

__all__ = [
    "block_times",
    "clips_shards",
    "dtensor_mesh",
    "dtensors",
    "end_of_step_s",
    "input_bytes",
    "loop_s",
    "rerun_s",
    "step_reduce_s",
    "weight_grad_share",
]


def block_times(
    env: Env,
    blocks: Sequence[BlockStats],
    samples: float,
    tp: int,
    recomputes: Callable[[int], bool],
    *,
    first: int,
    last: int,
    ops: bool = False,
) -> tuple[list[float], list[float], float]:
    """Per-block forward and backward seconds (compute / tp + tensor-parallel collectives)
    and the tensor-parallel share of them. ``first``/``last``: the list indices of the
    model's first and last block (``blocks[k]`` is block ``k - first`` of the model, which
    recomputes its forward in backward iff ``recomputes(k - first)``: all of it, or with
    ``ops`` the operators selective recomputation reruns, [Note: pricing selective
    recomputation] in planner/recompute.py)."""
    fwd, bwd = [], []
    tp_s = 0.0
    for k, b in enumerate(blocks):
        ends = {"first": k == first, "last": k == last}
        comm_f = tp_comm_s(env, b, samples, tp, **ends)
        comm_b = tp_comm_s(env, b, samples, tp, backward=True, **ends)
        # [Note: DTensor module overhead] in measure/probes.py: half of a forward + backward's
        # dispatch in each pass
        dispatch = tp_dispatch_s(env, b, tp) / 2
        f = env.fwd_s(b, samples, tp) + comm_f + dispatch
        recompute = recomputes(k - first)
        again = f
        if ops:  # its collectives and dispatch run again with its element-wise operators
            again = comm_f + dispatch + rerun_s(env, b, samples, tp)
        bw = env.bwd_s(b, samples, tp) + comm_b + dispatch + (again if recompute else 0.0)
        tp_s += comm_f + comm_b + 2 * dispatch + (comm_f + dispatch if recompute else 0.0)
        fwd.append(f)
        bwd.append(bw)
    return fwd, bwd, tp_s


def rerun_s(env: Env, block: BlockStats, samples: float, tp: int) -> float:
    """Seconds selective recomputation adds to ``block``'s backward on one of ``tp`` ranks:
    `planner.recompute.rerun_block`'s forward. Without a calibrated operator cost a pass is
    priced by its matmuls alone (the catalog's efficiency folds the rest into the FLOP rate),
    which would make a rerun of element-wise operators free: their bytes are priced at the
    device's memory bandwidth instead."""
    seconds = env.fwd_s(rerun_block(block), samples, tp)
    if env.profile is None or env.profile.op_s <= 0:
        seconds += block.ops_rerun_moved_bytes * samples / tp / env.mem_bw
    return seconds


def weight_grad_share(block: BlockStats) -> float:
    """Of ``block``'s backward compute, the part that is its weight gradient (zero bubble's W).

    [Note: splitting a backward] A Linear's backward is two matmuls as costly as its forward:
    ``dX = dY W^T``, which the previous layer waits for, and ``dW = X^T dY``, which only the
    optimizer step needs (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section
    2: their B and W, our I and W). Attention has no weights, so its backward is all I. Of the
    backward's `BACKWARD_FLOPS_PER_FORWARD` x the forward's FLOPs (attention counted in full),
    W is therefore the Linears' forward FLOPs:

        share = linear_fwd_flops / (2 fwd_flops)     (<= 1/2; 1/2 for a stack of Linears)

    A W is priced at that share of the block's backward pass (`Env.bwd_s`: its non-matmul time
    split alike, a simplification), an I at the rest of the backward: recomputation's forward,
    the tensor-parallel collectives and dispatch go with I, which needs them. A gpt layer
    (``24 T C^2`` Linear FLOPs of ``24 T C^2 + 4 T^2 C``) has ``1 / (2 (1 + T / 6C))``: 0.43
    at T = C, 0.25 at T = 6C; its head (one Linear) 1/2. Without the Linears' shapes or FLOPs:
    1/2, the paper's ``T_B = T_W``."""
    linear = sum(2.0 * fan_in * fan_out for fan_in, fan_out in block.linears)
    linear *= block.rows_per_sample
    # every attention call in full, whichever device counted it ([Note: attention kernels])
    fwd = block.fwd_flops - block.attention_counted + sum(a[3] for a in block.attention)
    if linear <= 0 or fwd <= 0:
        return 0.5
    return min(linear / (BACKWARD_FLOPS_PER_FORWARD * fwd), 1.0)


def end_of_step_s(
    layout: Layout, stats: ModelStats, env: Env, blocks: Sequence[BlockStats]
) -> float:
    """The end of step on one rank holding ``blocks`` (its stage): non-finite check, clip and
    update over its tensors and bytes (the tp shard; 1/dp of it under ZeRO-2/3), plus the
    step's small reductions (`step_reduce_s`)."""
    shard = sum(b.params_per_tp_rank(layout.tp) for b in blocks)
    shard /= layout.dp if layout.zero >= 2 else 1
    held_dtensors = dtensors(layout, blocks)
    update = env.optimizer_s(
        shard,
        stats.optimizer_state_per_param,
        stats.dtype_bytes,
        tensors=sum(b.tensors for b in blocks),
        optimizer=stats.optimizer,
        clip=stats.grad_clip,
        dtensors=held_dtensors,
        # the fused figures were timed on plain tensors; DTensors keep their own
        fused=stats.fused_optimizer and held_dtensors == 0,
    )
    return update + step_reduce_s(layout, stats, env, dtensor_mesh(layout, blocks))


def dtensors(layout: Layout, blocks: Sequence[BlockStats]) -> float:
    """[Note: DTensor end of step] in measure/probes.py: how many of a rank's parameter
    tensors are DTensors. FSDP2 makes every one of them a DTensor (ZeRO-2/3, a pipeline's
    ZeRO stages too, and its ``replicate`` for dp x tp); tensor parallelism alone the
    parameters of the modules its plan parallelizes (`BlockStats.tp_modules`; unknown: none
    counted). A PS or gossip replica, DDP and a pipeline stage without tp or ZeRO hold plain
    tensors."""
    spmd = layout.sync == "allreduce" and layout.pp == 1
    if layout.zero >= 2 or (spmd and layout.dp > 1 and layout.tp > 1):
        return float(sum(b.tensors for b in blocks))
    return float(sum(m.tensors for b in blocks for m in b.tp_applied(layout.tp)))


def dtensor_mesh(layout: Layout, blocks: Sequence[BlockStats]) -> int:
    """Ranks of the mesh a rank's DTensor gradients live on (1: none are DTensors): FSDP2's
    (ZeRO-2/3; its ``replicate`` over the tp ranks for dp x tp) spans dp x tp, tensor
    parallelism's alone the tp group ([Note: DTensor end of step] in measure/probes.py). A
    pipeline's ZeRO stages clip without DTensor's norm (`pipeline.sharded.StageSharding`
    sums the shards' squares itself): 1, their clip's reduce priced as a plain one."""
    if dtensors(layout, blocks) <= 0:
        return 1
    spmd = layout.sync == "allreduce" and layout.pp == 1
    if spmd and (layout.zero >= 2 or (layout.dp > 1 and layout.tp > 1)):
        return layout.dp * layout.tp
    return layout.tp


def step_reduce_s(layout: Layout, stats: ModelStats, env: Env, mesh: int = 1) -> float:
    """`core.step.finish_step`'s collectives: one all-reduce of [loss, non-finite flag] (two
    floats) over the replicas, and, when clipping sharded gradients (tensor parallel, ZeRO,
    pipeline stages), one more of the squared norm over the shards' group. Latency-bound:
    `Env.step_reduce_s`; a pipeline's stages reach them apart (the last stage ends its flush
    first and waits), so they keep the isolated price ([Note: the step's reductions in a
    step] in measure/probes.py). Over DTensor gradients on a ``mesh`` of several ranks the
    clip's norm is priced per call as calibrated, its all-reduce included ([Note: DTensor clip
    per call] in measure/probes.py), where the profile measured it."""
    ranks = layout.dp * layout.tp * layout.pp
    together = layout.pp == 1
    loss = env.step_reduce_s(ranks, together=together)
    if not clips_shards(layout, stats):
        return loss
    call = env.dtensor_clip_call_s(mesh)
    return loss + (call if call > 0 else env.step_reduce_s(ranks, together=together))


def clips_shards(layout: Layout, stats: ModelStats) -> bool:
    """Whether the step clips gradients sharded over ranks (tensor parallel, ZeRO-2/3,
    pipeline stages): its norm takes one all-reduce more (`step_reduce_s`)."""
    return stats.grad_clip and (layout.tp > 1 or layout.zero >= 2 or layout.pp > 1)


def loop_s(env: Env) -> tuple[float, float]:
    """(seconds per step, seconds per micro-batch) of the training step's own Python, as
    calibrated ([Note: loop overhead] in measure/calibrate_worker.py), slowed like all CPU work by
    shared cores; (0, 0) without a profile that measured it."""
    prof = env.profile
    if prof is None:
        return 0.0, 0.0
    return prof.loop_step_s * env.cpu_slowdown, prof.loop_microbatch_s * env.cpu_slowdown


def input_bytes(block: BlockStats) -> float:
    """Bytes per sample of ``block``'s input (what a pipeline stage receives in its forward and
    sends back as a gradient): its output scaled back through its first Linear."""
    if block.linears:
        fan_in, fan_out = block.linears[0]
        return (
            block.output_bytes * fan_in / fan_out if block.rows_per_sample else block.output_bytes
        )
    return block.output_bytes

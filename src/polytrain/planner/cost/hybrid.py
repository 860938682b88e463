"""Hybrid composition: dp x tp x pp (with ZeRO, recomputation, late multiply) or a PS layout.

The order is the runtime's (STYLE 3: tensor parallel -> recompute -> data parallel): a rank's
blocks are its pipeline stage's, each block's compute is split tp ways and pays its
tensor-parallel collectives, recomputation adds one forward to each backward, and data
parallel (DDP, ZeRO or the pipeline's flat all-reduce) combines the replicas. Mesh groups are
placed as `topology.ParallelDims` lays ranks out (``pp, dp, tp``, tp fastest), which decides
whether a group crosses hosts. Derivation: docs/planner.md "Hybrids".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from polytrain.planner.cost.common import Env
from polytrain.planner.cost.decentralized import gossip_exchange_s, localsgd_average_s
from polytrain.planner.cost.dp import dp_backward, replicate_backward
from polytrain.planner.cost.pipeline import PipelineTiming, pipeline_step
from polytrain.planner.cost.ps import ps_step
from polytrain.planner.cost.sufficient_factor import sf_block_s
from polytrain.planner.cost.tp import tp_comm_s, tp_dispatch_s
from polytrain.planner.cost.zero import zero_step
from polytrain.planner.memory import memory_per_rank, ps_server_memory
from polytrain.planner.partition import balanced_stages
from polytrain.planner.types import BlockStats, Layout, ModelStats, Prediction

__all__ = ["predict"]


def predict(layout: Layout, stats: ModelStats, env: Env, global_batch: int) -> Prediction:
    """Step time, memory and breakdown of ``layout`` for a step of ``global_batch`` samples."""
    if layout.pp > 1 and stats.layer_blocks:  # a user's model cut at its layers: their stages
        stats = replace(stats, blocks=stats.layer_blocks)  # [Note: layer view]
    stages = balanced_stages(stats.blocks, layout.pp)
    replica_samples = global_batch / layout.dp
    micro = layout.microbatches if layout.pp > 1 else layout.grad_accum
    if layout.pp > 1:
        micro *= layout.grad_accum
    mb_samples = replica_samples / micro
    mem = memory_per_rank(stats, layout, stages, mb_samples)
    total = mem.total
    if layout.sync == "ps":  # a server rank may be the busiest: it holds the optimizer state
        total = max(total, ps_server_memory(stats, layout).total)
    fits = total <= env.cluster.device.memory
    if layout.sync == "ps":
        step, breakdown = _ps(layout, stats, env, replica_samples)
    elif layout.sync in ("gossip", "localsgd"):
        step, breakdown = _decentralized(layout, stats, env, replica_samples)
    elif layout.pp > 1:
        step, breakdown = _pipeline(layout, stats, env, stages, mb_samples)
    else:
        step, breakdown = _spmd(layout, stats, env, mb_samples)
    breakdown["memory_" + "total"] = total
    why = "" if fits else f"out of memory ({_gib(total)} > {_gib(env.cluster.device.memory)})"
    if layout.pp > 1:  # the stages priced here are the ones `overrides` makes the runtime run
        layout = replace(layout, partition=tuple(len(s) for s in stages))
    return Prediction(layout, step, total, breakdown, fits, why)


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def _block_times(
    env: Env,
    blocks: Sequence[BlockStats],
    samples: float,
    tp: int,
    recompute: bool,
    *,
    first: int,
    last: int,
) -> tuple[list[float], list[float], float]:
    """Per-block forward and backward seconds (compute / tp + tensor-parallel collectives)
    and the tensor-parallel share of them. ``first``/``last``: model indices of the ends."""
    fwd, bwd = [], []
    tp_s = 0.0
    for k, b in enumerate(blocks):
        ends = {"first": k == first, "last": k == last}
        comm_f = tp_comm_s(env, b, samples, tp, **ends)
        comm_b = tp_comm_s(env, b, samples, tp, backward=True, **ends)
        # [Note: DTensor module overhead]: half of a forward + backward's dispatch in each pass
        dispatch = tp_dispatch_s(env, b, tp) / 2
        f = env.fwd_s(b, samples, tp) + comm_f + dispatch
        bw = env.bwd_s(b, samples, tp) + comm_b + dispatch + (f if recompute else 0.0)
        tp_s += comm_f + comm_b + 2 * dispatch + (comm_f + dispatch if recompute else 0.0)
        fwd.append(f)
        bwd.append(bw)
    return fwd, bwd, tp_s


def _optimizer(layout: Layout, stats: ModelStats, env: Env, blocks: Sequence[BlockStats]) -> float:
    """The end of step on one rank holding ``blocks`` (its stage): non-finite check, clip and
    update over its tensors and bytes (the tp shard; 1/dp of it under ZeRO-2/3), plus the
    step's small reductions (`_step_reduce_s`)."""
    shard = sum(b.params_per_tp_rank(layout.tp) for b in blocks)
    shard /= layout.dp if layout.zero >= 2 else 1
    update = env.optimizer_s(
        shard,
        stats.optimizer_state_per_param,
        stats.dtype_bytes,
        tensors=sum(b.tensors for b in blocks),
        optimizer=stats.optimizer,
        clip=stats.grad_clip,
        dtensors=_dtensors(layout, blocks),
    )
    return update + _step_reduce_s(layout, stats, env, _dtensor_mesh(layout, blocks))


def _dtensors(layout: Layout, blocks: Sequence[BlockStats]) -> float:
    """[Note: DTensor end of step] in planner/probes.py: how many of a rank's parameter
    tensors are DTensors. FSDP2 makes every one of them a DTensor (ZeRO-2/3, and its
    ``replicate`` for dp x tp); tensor parallelism alone the parameters of the modules its
    plan parallelizes (`BlockStats.tp_modules`; unknown: none counted). A PS or gossip
    replica, DDP and a pipeline stage without tp hold plain tensors."""
    spmd = layout.sync == "allreduce" and layout.pp == 1
    if spmd and (layout.zero >= 2 or (layout.dp > 1 and layout.tp > 1)):
        return float(sum(b.tensors for b in blocks))
    return float(sum(m.tensors for b in blocks for m in b.tp_applied(layout.tp)))


def _dtensor_mesh(layout: Layout, blocks: Sequence[BlockStats]) -> int:
    """Ranks of the mesh a rank's DTensor gradients live on (1: none are DTensors): FSDP2's
    (ZeRO-2/3; its ``replicate`` over the tp ranks for dp x tp) spans dp x tp, tensor
    parallelism's alone the tp group ([Note: DTensor end of step] in planner/probes.py)."""
    if _dtensors(layout, blocks) <= 0:
        return 1
    spmd = layout.sync == "allreduce" and layout.pp == 1
    if spmd and (layout.zero >= 2 or (layout.dp > 1 and layout.tp > 1)):
        return layout.dp * layout.tp
    return layout.tp


def _step_reduce_s(layout: Layout, stats: ModelStats, env: Env, mesh: int = 1) -> float:
    """`core.step.finish_step`'s collectives: one all-reduce of [loss, non-finite flag] (two
    floats) over the replicas, and, when clipping sharded gradients (tensor parallel, ZeRO,
    pipeline stages), one more of the squared norm over the shards' group. Latency-bound:
    `Env.step_reduce_s`; a pipeline's stages reach them apart (the last stage ends its flush
    first and waits), so they keep the isolated price ([Note: the step's reductions in a
    step] in planner/probes.py). Over DTensor gradients on a ``mesh`` of several ranks the
    clip's norm is priced per call as calibrated, its all-reduce included ([Note: DTensor clip
    per call] in planner/probes.py), where the profile measured it."""
    ranks = layout.dp * layout.tp * layout.pp
    together = layout.pp == 1
    loss = env.step_reduce_s(ranks, together=together)
    sharded = layout.tp > 1 or layout.zero >= 2 or layout.pp > 1
    if not (stats.grad_clip and sharded):
        return loss
    call = env.dtensor_clip_call_s(mesh)
    return loss + (call if call > 0 else env.step_reduce_s(ranks, together=together))


def _loop(env: Env) -> tuple[float, float]:
    """(seconds per step, seconds per micro-batch) of the training step's own Python, as
    calibrated ([Note: loop overhead] in planner/calibrate_worker.py), slowed like all CPU work by
    shared cores; (0, 0) without a profile that measured it."""
    prof = env.profile
    if prof is None:
        return 0.0, 0.0
    return prof.loop_step_s * env.cpu_slowdown, prof.loop_microbatch_s * env.cpu_slowdown


def _pipeline_runtime(env: Env, schedule: str) -> tuple[float, float]:
    """(seconds per F and per B, seconds per flush) the pipeline runtime adds beyond the loop's
    share, as calibrated for ``schedule`` on two stages ([Note: pipeline runtime overhead] in
    planner/calibrate_worker.py: mostly waiting, so not slowed by the shared cores); (0, 0)
    without a profile that measured it."""
    prof = env.profile
    if prof is None:
        return 0.0, 0.0
    return prof.pipe_action_s.get(schedule, 0.0), prof.pipe_flush_s.get(schedule, 0.0)


def _spmd(
    layout: Layout, stats: ModelStats, env: Env, mb_samples: float
) -> tuple[float, dict[str, float]]:
    blocks = stats.blocks
    n = len(blocks)
    fwd, bwd, tp_s = _block_times(
        env, blocks, mb_samples, layout.tp, layout.recompute, first=0, last=n - 1
    )
    compute = (sum(fwd) + sum(bwd)) * layout.grad_accum
    tp_s *= layout.grad_accum
    grad_bytes = [b.bytes_per_tp_rank(layout.tp) for b in blocks]
    dp, stride = layout.dp, layout.tp
    units = n + 1  # FSDP2's: every block, then the root
    if layout.zero:
        z_fwd, z_bwd, z_bytes = fwd, bwd, grad_bytes
        if stats.fsdp_units:  # [Note: FSDP units of a user's model] in planner/layer_stats.py
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
    opt = _optimizer(layout, stats, env, blocks)
    # FSDP2's hooks on every wrapped block and the root, once per micro-step: ZeRO-2/3, and
    # FSDP2's replicate for dp x tp (parallel/family.py: DDP cannot take DTensor parameters)
    fsdp_stage = layout.zero if layout.zero else (0 if dp > 1 and layout.tp > 1 else -1)
    tensors = sum(b.tensors for b in blocks)
    fsdp = env.fsdp_overhead_s(fsdp_stage, units, tensors) if fsdp_stage >= 0 else 0.0
    fsdp *= layout.grad_accum
    per_step, per_micro = _loop(env)
    loop = per_step + per_micro * layout.grad_accum
    # every rank waits for every other each step (the collectives, the end of step's reduce):
    # for the stalls of the others' own work since ([Note: ranks' skew] in planner/contention.py)
    skew = env.skew_s(compute - tp_s + opt + fsdp + loop, dp * layout.tp)
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


# [Note: a pipeline's shared cores] A pipeline's ranks do not all compute at once: a stage
# idles in its bubble and while it waits for a message. On a host with more ranks than cores
# ([Note: shared cores] in cost/common.py) a stage computes faster while its peers wait than
# while they compute. The stages' F and B are priced with every rank of the host computing
# (the full count), and the simulation shares the cores among the stages computing at each
# instant ([Note: shared-core simulation] in cost/pipeline.py): with n of p stages computing,
# n x (host ranks / p) ranks compute on the host (a stage's dp replicas and tp ranks run in
# step with it), and a stage advances at slowdown(full) / slowdown(that count) of its priced
# speed. The step's end (optimizer, dp all-reduce, the loop's per-step Python), which every
# rank runs at once, keeps the full count. Until 2026-11-27 the stages were priced at one count,
# the mean (utilization x ranks): on five runs on two 2-vCPU hosts that priced gpt tiny's pp4
# 1F1B m8 5-27% low (mean -18%), the instant count -18..+1% (mean -9%); docs/planner.md
# "A pipeline's shared cores".


def _pipeline(
    layout: Layout,
    stats: ModelStats,
    env: Env,
    stages: Sequence[Sequence[BlockStats]],
    mb_samples: float,
) -> tuple[float, dict[str, float]]:
    # PipelineStrategy.train_step runs the m-micro-batch program once per accumulation
    # micro-step, each with its flush (PipeDream streams instead and ignores accumulation).
    runs = 1 if layout.schedule == "pipedream" else layout.grad_accum
    run = _pipeline_stages(layout, stats, env, stages, mb_samples, _shared_speed(env, len(stages)))
    timing = run.timing
    # The pipeline's dp all-reduce (comm/flat.py) runs after the flush, stage by stage in
    # parallel: the slowest stage's is on the critical path. PipeDream's is deferred into
    # the next step (StepOutput.complete) and hides behind it.
    dp_s = max(
        env.collective_s(
            "all_reduce", sum(b.bytes_per_tp_rank(layout.tp) for b in blocks), layout.dp, layout.tp
        )
        for blocks in stages
    )
    if layout.schedule == "pipedream":
        dp_s = max(0.0, dp_s - timing.per_step)
    opt = max(_optimizer(layout, stats, env, blocks) for blocks in stages)
    per_step = _loop(env)[0]
    step = (timing.per_step + run.flush) * runs + dp_s + opt + per_step
    tp_s, loop_micro, runtime = (x * runs for x in (run.tp_comm, run.loop_micro, run.runtime))
    return step, {
        "compute": max(timing.busy) * runs - tp_s - loop_micro - runtime,
        "tp_comm": tp_s,
        "dp_comm": dp_s,
        "bubble": timing.bubble * runs,
        "optimizer": opt,
        "loop": per_step + loop_micro,
        "pipeline_runtime": runtime + run.flush * runs,
    }


@dataclass(frozen=True)
class _StagesRun:
    """One run of a pipeline's program (`_pipeline_stages`): its simulated timing, the flush's
    seconds, and the busiest stage's tensor-parallel comm, the loop's micro-batch share and the
    runtime's own seconds over its F and B."""

    timing: PipelineTiming
    flush: float
    tp_comm: float
    loop_micro: float
    runtime: float


def _shared_speed(env: Env, stages: int) -> list[float] | None:
    """[Note: a pipeline's shared cores]: how fast a stage computes while ``n`` of the
    pipeline's ``stages`` do (index n), against every rank of the host computing (what
    ``env`` prices); None where the ranks do not share cores."""
    full = env.cpu_slowdown
    if full <= 1.0:
        return None
    per_stage = env.host_ranks / stages  # the replicas and tp ranks of a stage run with it
    return [1.0] + [
        full / replace(env, computing=max(n * per_stage, 1.0)).cpu_slowdown
        for n in range(1, stages + 1)
    ]


def _pipeline_stages(
    layout: Layout,
    stats: ModelStats,
    env: Env,
    stages: Sequence[Sequence[BlockStats]],
    mb_samples: float,
    speed: Sequence[float] | None = None,
) -> _StagesRun:
    """One run of the m-micro-batch program of ``stages``, compute priced by ``env`` (every
    rank of the host computing), the stages sharing its cores at ``speed``
    (`cost.pipeline.simulate_shared`)."""
    n = len(stats.blocks)
    fwd_s, bwd_s, send_f, send_b, tp_total = [], [], [], [], 0.0
    start = 0
    # [Note: loop overhead]: every stage calls its module and runs a backward per micro-batch
    # (the first fetches its inputs, the last its targets), so a micro-batch's share of the
    # loop's Python goes half into each F and B of every stage, through the simulation
    per_micro = _loop(env)[1]
    action_s, flush_s = _pipeline_runtime(env, layout.schedule)
    pp_stride = layout.dp * layout.tp  # pp is the outermost mesh axis
    for blocks in stages:
        f, b, tp_s = _block_times(
            env, blocks, mb_samples, layout.tp, layout.recompute, first=-start, last=n - 1 - start
        )
        start += len(blocks)
        fwd_s.append(sum(f) + per_micro / 2 + action_s)
        bwd_s.append(sum(b) + per_micro / 2 + action_s)
        tp_total = max(tp_total, tp_s)
        out = blocks[-1].output_bytes * mb_samples / layout.tp
        # the runtime posts its receives ahead: [Note: posted receives] in comm/probe.py
        send_f.append(env.posted_p2p_s(out, pp_stride))
        inp = _input_bytes(blocks[0]) * mb_samples / layout.tp
        send_b.append(env.posted_p2p_s(inp, pp_stride))
    # the runtime's own per-action figure is mostly waiting: it does not share the cores
    fixed = [action_s] * len(stages)
    timing = pipeline_step(
        layout.schedule, layout.microbatches, fwd_s, bwd_s, send_f, send_b, speed, fixed
    )
    m = layout.microbatches
    return _StagesRun(timing, flush_s, tp_total * m, per_micro * m, 2 * action_s * m)


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


def _input_bytes(block: BlockStats) -> float:
    if block.linears:
        fan_in, fan_out = block.linears[0]
        return (
            block.output_bytes * fan_in / fan_out if block.rows_per_sample else block.output_bytes
        )
    return block.output_bytes


def _ps(
    layout: Layout, stats: ModelStats, env: Env, replica_samples: float
) -> tuple[float, dict[str, float]]:
    # The servers wait on the network while the workers compute: only workers share the cores.
    env = replace(env, computing=min(layout.dp, env.cluster.per_host))
    compute = sum(
        env.fwd_s(b, replica_samples) + env.bwd_s(b, replica_samples) for b in stats.blocks
    )
    # a worker checks and clips its gradient before it pushes (core.step.apply_update)
    tensors = sum(b.tensors for b in stats.blocks)
    parts = ("check", "clip") if stats.grad_clip else ("check",)
    compute += env.step_cost_s(parts, tensors, float(stats.param_bytes))
    per_step, per_micro = _loop(env)  # a worker's own loop ([Note: loop overhead])
    loop = per_step + per_micro
    # sync: every worker waits for the slowest at the servers each step ([Note: ranks' skew])
    skew = env.skew_s(compute, layout.dp) if layout.ps_mode == "sync" else 0.0
    compute += loop + skew
    step, comm = ps_step(
        env,
        layout.ps_mode,
        layout.dp,
        max(layout.ps_servers, 1),
        compute,
        float(stats.param_bytes),
        float(stats.params),
        stats.optimizer_state_per_param,
        stats.dtype_bytes,
        tensors=tensors,
        optimizer=stats.optimizer,
    )
    return step, {
        "compute": compute - loop - skew,
        "tp_comm": 0.0,
        "dp_comm": comm,
        "bubble": 0.0,
        "optimizer": 0.0,
        "loop": loop,
        "skew": skew,
    }


def _decentralized(
    layout: Layout, stats: ModelStats, env: Env, replica_samples: float
) -> tuple[float, dict[str, float]]:
    """Whole-model replicas: local compute, the end of step, then the exchange (gossip round or
    local SGD's amortized average), nothing overlapped; see cost/decentralized.py."""
    compute = sum(
        env.fwd_s(b, replica_samples) + env.bwd_s(b, replica_samples) for b in stats.blocks
    )
    opt = _optimizer(layout, stats, env, stats.blocks)
    per_step, per_micro = _loop(env)  # [Note: loop overhead]
    loop = per_step + per_micro
    model_bytes = float(stats.param_bytes)  # the flat fp32 model (gossip.compress = "none")
    if layout.sync == "gossip":
        comm = gossip_exchange_s(env, layout.topology, layout.dp, model_bytes)
    else:
        comm = localsgd_average_s(env, layout.dp, model_bytes, layout.period)
    return compute + opt + comm + loop, {
        "compute": compute,
        "tp_comm": 0.0,
        "dp_comm": comm,
        "bubble": 0.0,
        "optimizer": opt,
        "loop": loop,
    }

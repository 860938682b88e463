"""A pipeline layout priced: its stages through the schedule's simulation, then the step's end.

`stages_step` prices each virtual stage's actions (its blocks' passes from `cost.parts`, a
split backward's I and W by [Note: splitting a backward] there, the runtime's own per-action
and per-flush seconds as calibrated), runs the schedule's action lists with its stage map
through `cost.pipeline` (on a host whose ranks share cores, `simulate_shared`), and adds what
follows the flush: each rank's data-parallel all-reduce (ZeRO stages run none: their gathers
and reduce-scatter sit on the actions that make them, `cost.zero_stages`), the end of step and
the loop's per-step Python. One stage per rank for GPipe, 1F1B, PipeDream and ZB-H1; ``v`` for
interleaved 1F1B, two for ZBV (`planner.schedules`). Derivation: docs/planner.md "Pipeline",
"A pipeline's shared cores".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from polytrain.pipeline.schedule import NEXT_SCHEDULE_NAMES, ActionKind, StageMap
from polytrain.planner.cost.common import Env, Shape
from polytrain.planner.cost.parts import (
    block_times,
    end_of_step_s,
    input_bytes,
    loop_s,
    weight_grad_share,
)
from polytrain.planner.cost.pipeline import PipelineTiming, pipeline_step
from polytrain.planner.cost.zero_stages import (
    StageCollectives,
    action_comm,
    in_actions,
    stage_collectives,
)
from polytrain.planner.schedules import by_rank, layout_compute, layout_program
from polytrain.planner.types import BlockStats, Layout, ModelStats

__all__ = ["stages_layout_step", "stages_step"]


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


def stages_layout_step(
    layout: Layout, stats: ModelStats, env: Env, shape: Shape
) -> tuple[float, dict[str, float]]:
    """Step seconds and breakdown of a pipeline ``layout`` (its registry row names this
    module) over the balanced stages the prediction chose."""
    return stages_step(layout, stats, env, shape.stages, shape.mb_samples)


def stages_step(
    layout: Layout,
    stats: ModelStats,
    env: Env,
    stages: Sequence[Sequence[BlockStats]],
    mb_samples: float,
) -> tuple[float, dict[str, float]]:
    """Step seconds and breakdown of pipeline ``layout`` over ``stages`` (each a list of the
    model's blocks; one per virtual stage, in model order), ``mb_samples`` samples per
    micro-batch."""
    # PipelineStrategy.train_step runs the m-micro-batch program once per accumulation
    # micro-step, each with its flush (PipeDream streams instead and ignores accumulation).
    runs = 1 if layout.schedule == "pipedream" else layout.grad_accum
    speed = _shared_speed(env, layout.pp)
    run = _pipeline_stages(layout, stats, env, stages, mb_samples, speed)
    # ZeRO-2's gather and every reduce-scatter fall in one run of an accumulating step
    # (`cost.zero_stages`); the others gather per micro-batch (ZeRO-3) or not at all. Both
    # once-a-step collectives are priced in the same run, not in the first and the last.
    rest = run
    zero_stages = in_actions(layout)
    if runs > 1 and zero_stages:
        rest = _pipeline_stages(layout, stats, env, stages, mb_samples, speed, once=False)
    ranks = by_rank(stages, layout_compute(layout)[1])  # each rank's blocks, all its stages'
    # The pipeline's dp all-reduce (comm/flat.py) runs after the flush, rank by rank in
    # parallel: the slowest rank's is on the critical path. PipeDream's is deferred into
    # the next step (StepOutput.complete) and hides behind it. ZeRO stages run none: their
    # collectives are inside the simulated actions (`run.zero_comm`; tensor-parallel ones
    # excepted, [Note: tensor-parallel ZeRO stages] in cost/zero_stages.py).
    dp_s = 0.0
    if not zero_stages:
        dp_s = max(
            env.collective_s(
                "all_reduce",
                sum(b.bytes_per_tp_rank(layout.tp) for b in blocks),
                layout.dp,
                layout.tp,
            )
            for blocks in ranks
        )
    if layout.schedule == "pipedream":
        dp_s = max(0.0, dp_s - run.timing.per_step)
    opt = max(end_of_step_s(layout, stats, env, blocks) for blocks in ranks)
    per_step = loop_s(env)[0]
    step = run.timing.per_step + rest.timing.per_step * (runs - 1) + run.flush * runs
    step += dp_s + opt + per_step
    tp_s, loop_micro, runtime, fsdp = (
        x * runs for x in (run.tp_comm, run.loop_micro, run.runtime, run.fsdp)
    )
    zero_s = run.zero_comm + rest.zero_comm * (runs - 1)
    busy = max(run.timing.busy) + max(rest.timing.busy) * (runs - 1)
    bubble = run.timing.bubble + rest.timing.bubble * (runs - 1)
    return step, {
        "compute": busy - tp_s - loop_micro - runtime - fsdp - zero_s,
        "tp_comm": tp_s,
        "dp_comm": dp_s + zero_s,
        "fsdp_hooks": fsdp,
        "bubble": bubble,
        "optimizer": opt,
        "loop": per_step + loop_micro,
        "pipeline_runtime": runtime + run.flush * runs,
    }


@dataclass(frozen=True)
class _StagesRun:
    """One run of a pipeline's program (`_pipeline_stages`): its simulated timing, the flush's
    seconds, and the busiest rank's tensor-parallel comm, the loop's micro-batch share and the
    runtime's own seconds over its compute actions."""

    timing: PipelineTiming
    flush: float
    tp_comm: float
    loop_micro: float
    runtime: float
    zero_comm: float = 0.0  # the busiest rank's ZeRO collectives (`cost.zero_stages`)
    fsdp: float = 0.0  # the busiest rank's FSDP2 hooks (ZeRO stages)


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


def _pipeline_runtime(env: Env, schedule: str) -> tuple[float, float]:
    """(seconds per compute action, seconds per flush) the pipeline runtime adds beyond the
    loop's share, as calibrated for ``schedule`` on two stages ([Note: pipeline runtime
    overhead] in measure/calibrate_worker.py: mostly waiting, so not slowed by the shared
    cores); (0, 0) without a profile that measured it. A schedule calibration has not timed
    (interleaved 1F1B, ZB-H1, ZBV: `polytrain calibrate` times the planner's `SCHEDULES`) takes
    1F1B's figures per action (an I and a W are an action each) and per flush."""
    prof = env.profile
    if prof is None:
        return 0.0, 0.0
    uncalibrated = schedule in NEXT_SCHEDULE_NAMES and schedule not in prof.pipe_action_s
    key = "1f1b" if uncalibrated else schedule
    return prof.pipe_action_s.get(key, 0.0), prof.pipe_flush_s.get(key, 0.0)


def _pipeline_stages(
    layout: Layout,
    stats: ModelStats,
    env: Env,
    stages: Sequence[Sequence[BlockStats]],
    mb_samples: float,
    speed: Sequence[float] | None = None,
    *,
    once: bool = True,
) -> _StagesRun:
    """One run of the m-micro-batch program of ``stages`` (one per virtual stage), compute
    priced by ``env`` (every rank of the host computing), the ranks sharing its cores at
    ``speed`` (`cost.pipeline.simulate_shared`). ZeRO stages: ``once``, the run makes the
    step's once-a-step collectives (`cost.zero_stages`)."""
    program, stage_map = layout_program(layout)
    split = any(a is not None and a.kind is ActionKind.I for a in program[0])
    n = len(stats.blocks)
    fwd_s, bwd_s, input_s, weight_s, send_f, send_b = [], [], [], [], [], []
    tp_ranks = [0.0] * layout.pp
    start = 0
    # [Note: loop overhead] in measure/calibrate_worker.py: every stage calls its module and
    # runs a backward per micro-batch (the first fetches its inputs, the last its targets), so
    # a micro-batch's share of the loop's Python goes half into the forwards and half into the
    # backwards of every rank, through the simulation: spread over a rank's stages, and a split
    # backward's half over its I and W alike
    per_micro = loop_s(env)[1]
    share = per_micro / (2 * stage_map.stages_per_rank)
    action_s, flush_s = _pipeline_runtime(env, layout.schedule)
    zero: list[StageCollectives] = []
    hooks = [0.0] * len(stages)
    for s, blocks in enumerate(stages):
        f, b, tp_s = block_times(
            env,
            blocks,
            mb_samples,
            layout.tp,
            layout.recomputes,
            first=-start,
            last=n - 1 - start,
            ops=layout.recompute_ops,
        )
        start += len(blocks)
        if in_actions(layout):  # FSDP2's hooks on each block and the stage, half in each pass
            tensors = sum(k.tensors for k in blocks)
            hooks[s] = env.fsdp_overhead_s(layout.zero, len(blocks) + 1, tensors) / 2
            zero.append(stage_collectives(env, layout, blocks, f, b))
        fwd_s.append(sum(f) + share + action_s + hooks[s])
        bwd_s.append(sum(b) + share + action_s + hooks[s])
        if split:  # [Note: splitting a backward] in cost/parts.py
            w = sum(env.bwd_s(k, mb_samples, layout.tp) * weight_grad_share(k) for k in blocks)
            input_s.append(sum(b) - w + share / 2 + action_s)
            weight_s.append(w + share / 2 + action_s)
        tp_ranks[stage_map.rank_of(s)] += tp_s
        out = blocks[-1].output_bytes * mb_samples / layout.tp
        # the runtime posts its receives ahead: [Note: posted receives] in comm/probe.py
        send_f.append(_message_s(env, layout, stage_map, s, s + 1, out))
        inp = input_bytes(blocks[0]) * mb_samples / layout.tp
        send_b.append(_message_s(env, layout, stage_map, s, s - 1, inp))
    # the runtime's own per-action figure is mostly waiting: it does not share the cores
    fixed = [action_s] * len(stages)
    comm = action_comm(program, zero, first=once, last=once) if zero else {}
    timing = pipeline_step(
        layout.schedule,
        layout.microbatches,
        fwd_s,
        bwd_s,
        send_f,
        send_b,
        speed,
        fixed,
        virtual_stages=layout.virtual_stages,
        input_s=input_s if split else None,
        weight_s=weight_s if split else None,
        comm_s=comm,
    )
    m = layout.microbatches
    # compute actions of the busiest rank: 2m for one stage per rank, 2vm interleaved, 3m ZB-H1
    actions = max(sum(1 for a in row if a is not None and a.is_compute) for row in program.values())
    # the ZeRO collectives and hooks of the rank that computes longest (its busy seconds hold them)
    busiest = max(range(layout.pp), key=lambda r: timing.busy[r])
    mine = [a for a in program[busiest] if a is not None and a.is_compute]
    zero_comm = sum(comm.get((a.kind, a.stage_index, a.microbatch_index), 0.0) for a in mine)
    fsdp = sum(hooks[a.stage_index] for a in mine)
    return _StagesRun(
        timing,
        flush_s,
        max(tp_ranks) * m,
        per_micro * m,
        action_s * actions,
        zero_comm,
        fsdp,
    )


def _message_s(
    env: Env, layout: Layout, stage_map: StageMap, stage: int, peer: int, nbytes: float
) -> float:
    """Seconds of one message from ``stage`` to ``peer`` (0 when they share a rank: [Note:
    local hand-off] in pipeline/schedule/lowering.py).

    [Note: a message's link] pp is the outermost mesh axis, so neighbouring pipeline ranks are
    dp x tp ranks apart, and a message ``hop`` pipeline ranks away (interleaved 1F1B's last
    rank back to rank 0) ``hop`` times that. Ranks fill hosts in order, so that message stays
    in a host iff the whole pipeline group does; it is priced on the group's link then, and on
    the link of its own stride otherwise."""
    pp_stride = layout.dp * layout.tp  # pp is the outermost mesh axis
    if not 0 <= peer < stage_map.num_stages:
        return 0.0  # never sent: the pipeline's ends
    hop = abs(stage_map.rank_of(peer) - stage_map.rank_of(stage))
    if hop == 0:
        return 0.0
    if hop > 1 and env.link(pp_stride, layout.pp) is not env.cluster.intra:
        return env.posted_p2p_s(nbytes, hop * pp_stride)
    return env.posted_p2p_s(nbytes, pp_stride)

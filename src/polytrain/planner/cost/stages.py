"""A pipeline layout priced: its stages through the schedule's simulation, then the step's end.

`stages_step` prices one rank per stage (its blocks' passes from `cost.parts`, the runtime's
own per-action and per-flush seconds as calibrated), runs the schedule's action lists through
`cost.pipeline` (on a host whose ranks share cores, `simulate_shared`), and adds what follows
the flush: the stages' data-parallel all-reduce, the end of step and the loop's per-step
Python. Derivation: docs/planner.md "Pipeline", "A pipeline's shared cores".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from polytrain.planner.cost.common import Env, Shape
from polytrain.planner.cost.parts import block_times, end_of_step_s, input_bytes, loop_s
from polytrain.planner.cost.pipeline import PipelineTiming, pipeline_step
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
    model's blocks), ``mb_samples`` samples per micro-batch."""
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
    opt = max(end_of_step_s(layout, stats, env, blocks) for blocks in stages)
    per_step = loop_s(env)[0]
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


def _pipeline_runtime(env: Env, schedule: str) -> tuple[float, float]:
    """(seconds per F and per B, seconds per flush) the pipeline runtime adds beyond the loop's
    share, as calibrated for ``schedule`` on two stages ([Note: pipeline runtime overhead] in
    measure/calibrate_worker.py: mostly waiting, so not slowed by the shared cores); (0, 0)
    without a profile that measured it."""
    prof = env.profile
    if prof is None:
        return 0.0, 0.0
    return prof.pipe_action_s.get(schedule, 0.0), prof.pipe_flush_s.get(schedule, 0.0)


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
    # [Note: loop overhead] in measure/calibrate_worker.py: every stage calls its module and
    # runs a backward per micro-batch (the first fetches its inputs, the last its targets), so
    # a micro-batch's share of the loop's Python goes half into each F and B of every stage,
    # through the simulation
    per_micro = loop_s(env)[1]
    action_s, flush_s = _pipeline_runtime(env, layout.schedule)
    pp_stride = layout.dp * layout.tp  # pp is the outermost mesh axis
    for blocks in stages:
        f, b, tp_s = block_times(
            env, blocks, mb_samples, layout.tp, layout.recompute, first=-start, last=n - 1 - start
        )
        start += len(blocks)
        fwd_s.append(sum(f) + per_micro / 2 + action_s)
        bwd_s.append(sum(b) + per_micro / 2 + action_s)
        tp_total = max(tp_total, tp_s)
        out = blocks[-1].output_bytes * mb_samples / layout.tp
        # the runtime posts its receives ahead: [Note: posted receives] in comm/probe.py
        send_f.append(env.posted_p2p_s(out, pp_stride))
        inp = input_bytes(blocks[0]) * mb_samples / layout.tp
        send_b.append(env.posted_p2p_s(inp, pp_stride))
    # the runtime's own per-action figure is mostly waiting: it does not share the cores
    fixed = [action_s] * len(stages)
    timing = pipeline_step(
        layout.schedule, layout.microbatches, fwd_s, bwd_s, send_f, send_b, speed, fixed
    )
    m = layout.microbatches
    return _StagesRun(timing, flush_s, tp_total * m, per_micro * m, 2 * action_s * m)

"""ZeRO inside pipeline stages priced: each stage's gathers and its one reduce-scatter per step,
placed on the very actions of the schedule that make them.

ZeRO (Rajbhandari et al. SC20) composed with a synchronous pipeline as `pipeline.sharded` runs
it ([Note: ZeRO inside stages] there): FSDP2 shards each stage's blocks over the stage's ``dp``
peers. Per step and per stage the runtime

- reduce-scatters the gradients once, in the stage's last backward of the step
  (`pipeline.schedule.last_backwards`; earlier backwards accumulate unsharded gradients);
- ZeRO-2 gathers the parameters once, in the stage's first forward of the step
  (`pipeline.schedule.first_forwards`), and keeps them whole until that last backward;
- ZeRO-3 gathers each block for every micro-batch's forward and again for its backward.

With gradient accumulation (``train.grad_accum`` runs of the program per step) ZeRO-2 still
gathers once and both reduce once per step; ZeRO-3 gathers in every run.

Each action's collectives are priced by `cost.zero.zero_step`, the pp = 1 ZeRO model, over the
stage's blocks: the difference between its ends with and without a collective is what that
collective adds to the action. So they overlap with compute exactly as there: not at all on a
CPU host, where FSDP2's collectives block the one thread that computes ([Note: FSDP2 on a CPU
host] in cost/zero.py), and on an accelerator behind the neighbouring block's compute
(prefetch depth one; the runtime sets each block's backward prefetch to the block before it,
[Note: backward prefetch in stages] in pipeline/sharded.py), the first block's gather and the
last block's reduce-scatter exposed. The seconds go into the schedule's simulation on the
action they delay (`cost.pipeline.ActionComm`; on an accelerator too they start once the
action's input has arrived: [Note: collectives in an action] in cost/pipeline.py), so a stage's
first gather lies on the pipeline's fill and its reduce-scatter delays the input gradient it
sends in its last backward, and with it the drain of the stages before it. They
replace the pipeline's data-parallel all-reduce after the flush, which ZeRO stages do not run.

[Note: tensor-parallel ZeRO stages] The runtime refuses ZeRO in tensor-parallel stages
(`pipeline.schedule.zero_stages_problem`), and the search and ``plan --layout`` follow it; the
cost model still prices such a layout, because published runs used one (BLOOM: DeepSpeed's
ZeRO-1 with tp 4 and pp 12; Megatron's distributed optimizer is the same), and prices it as
those runtimes run it: the gradients reduced after the flush and the updated shards gathered
after the step, every stage at once, i.e. the pipeline's data-parallel all-reduce
(`cost.stages`), not in the actions. Their memory is the ZeRO stages' (a whole gradient
accumulated over the micro-batches, as a ZeRO-1 pipeline holds it too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from polytrain.pipeline.schedule import ActionKind, Schedule, first_forwards, last_backwards
from polytrain.planner.cost.common import Env
from polytrain.planner.cost.pipeline import ActionComm
from polytrain.planner.cost.zero import zero_step
from polytrain.planner.types import BlockStats, Layout

__all__ = ["StageCollectives", "action_comm", "in_actions", "stage_collectives"]


def in_actions(layout: Layout) -> bool:
    """Whether ``layout``'s ZeRO collectives sit in its stages' actions, as the runtime runs
    them (tp = 1), rather than after the flush ([Note: tensor-parallel ZeRO stages])."""
    return layout.pp > 1 and layout.zero >= 2 and layout.tp == 1


@dataclass(frozen=True)
class StageCollectives:
    """Seconds one virtual stage's ZeRO collectives add to its actions."""

    every_f: float  # each forward (ZeRO-3's gathers)
    every_b: float  # each backward (ZeRO-3's gathers again)
    first_f: float  # the step's first forward, beyond every_f (ZeRO-2's one gather)
    last_b: float  # the step's last backward, beyond every_b (the reduce-scatter)


def stage_collectives(
    env: Env,
    layout: Layout,
    blocks: Sequence[BlockStats],
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
) -> StageCollectives:
    """What ``layout.zero``'s collectives add to one stage's forward and backward of one
    micro-batch, its blocks' compute being ``fwd_s`` and ``bwd_s`` (forward order)."""
    nbytes = [b.bytes_per_tp_rank(layout.tp) for b in blocks]
    dp, stride = layout.dp, layout.tp  # mesh order pp, dp, tp: a stage's dp peers tp apart
    fwd, bwd = sum(fwd_s), sum(bwd_s)
    f_end, b_plain, _ = zero_step(env, layout.zero, fwd_s, bwd_s, nbytes, dp, stride, scatter=False)
    b_last = zero_step(env, layout.zero, fwd_s, bwd_s, nbytes, dp, stride)[1]
    if layout.zero == 3:
        return StageCollectives(f_end - fwd, b_plain - bwd, 0.0, b_last - b_plain)
    return StageCollectives(0.0, 0.0, f_end - fwd, b_last - bwd)


def action_comm(
    program: Schedule, stages: Sequence[StageCollectives], *, first: bool, last: bool
) -> ActionComm:
    """(kind, stage, micro-batch) -> seconds of collectives, for every compute action of one
    run of ``program`` (rank -> actions): ``first``: the run makes the step's first forwards
    (ZeRO-2 gathers in them), ``last``: its last backwards (the reduce-scatters)."""
    out: dict[tuple[ActionKind, int, int], float] = {}
    for row in program.values():
        gathers = first_forwards(row) if first else {}
        reduces = last_backwards(row) if last else {}
        for a in row:
            if a is None or a.kind not in (ActionKind.F, ActionKind.B):
                continue
            c = stages[a.stage_index]
            if a.kind is ActionKind.F:
                once = gathers.get(a.stage_index) == a.microbatch_index
                secs = c.every_f + (c.first_f if once else 0.0)
            else:
                once = reduces.get(a.stage_index) == a.microbatch_index
                secs = c.every_b + (c.last_b if once else 0.0)
            out[(a.kind, a.stage_index, a.microbatch_index)] = secs
    return out

"""The planner prices interleaved 1F1B, ZB-H1 and ZBV by simulating the runtime's action lists
(pure, milliseconds): the bubbles of `pipeline.schedule.formulas` from the simulation, the
memory from the schedules' peaks, the refusals, and the old schedules' figures unchanged."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from polytrain.errors import PlanError
from polytrain.pipeline.schedule import (
    bubble_fraction,
    interleaved_bubble_ratio,
    interleaved_peak_activations,
    one_f_one_b_idle_time,
    zb_h1_idle_time,
    zbv_idle_steps,
)
from polytrain.planner.cluster import parse_cluster
from polytrain.planner.cost import Env, predict
from polytrain.planner.cost.parts import weight_grad_share
from polytrain.planner.cost.pipeline import pipeline_step, simulate_program, simulate_shared
from polytrain.planner.memory import memory_per_rank
from polytrain.planner.partition import balanced_stages
from polytrain.planner.profile_io import load_profile
from polytrain.planner.schedules import by_rank, lowered_program, pipeline_problem
from polytrain.planner.search import enumerate_layouts
from polytrain.planner.stats_pure import gpt_stats
from polytrain.planner.types import BlockStats, Layout, ModelStats
from tests.helpers import planner as planner_helpers

ROOT = Path(__file__).resolve().parents[2]
C, T = 1024, 128


def equal_blocks(n: int) -> ModelStats:
    """``n`` identical one-Linear blocks whose outputs cost nothing to send (0 bytes): equal
    stages and free messages, the setting of the papers' formulas."""
    return planner_helpers.equal_blocks(n, C, T, output_bytes=0.0)


def zeros(n: int) -> list[float]:
    return [0.0] * n


# --- the simulation against the closed forms --------------------------------------------------


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("b_over_f", [1.0, 2.0])
def test_interleaved_bubble_is_sc21s(p: int, v: int, groups: int, b_over_f: float) -> None:
    """Each chunk's F and B take 1/v of a whole stage's; idle over busy is (p - 1) / (v m)
    (`interleaved_bubble_ratio`), and at v = 1 the makespan is 1F1B's."""
    m, stages = groups * p, p * v
    fwd, bwd = [1.0 / v] * stages, [b_over_f / v] * stages
    t = pipeline_step(
        "interleaved-1f1b", m, fwd, bwd, zeros(stages), zeros(stages), virtual_stages=v
    )
    assert all(busy == pytest.approx(m * (1 + b_over_f)) for busy in t.busy)
    assert t.bubble / max(t.busy) == pytest.approx(interleaved_bubble_ratio(p, m, v))
    if v == 1:
        plain = pipeline_step("1f1b", m, fwd, bwd, zeros(p), zeros(p))
        assert t.makespan == pytest.approx(plain.makespan)
        assert t.bubble / t.makespan == pytest.approx(bubble_fraction(p, m))


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m_extra", [0, 1, 5])
@pytest.mark.parametrize(("t_f", "t_i", "t_w"), [(1.0, 1.0, 1.0), (2.0, 2.0, 1.0), (1.5, 1.2, 1.0)])
def test_zb_h1_idles_as_qi_et_al(p: int, m_extra: int, t_f: float, t_i: float, t_w: float) -> None:
    """Every rank idles (p - 1)(t_f + t_i - t_w) under ZB-H1 (m >= p, t_w <= min(t_f, t_i)),
    and 1F1B with the unsplit B = t_i + t_w idles (p - 1)(t_f + t_i + t_w)."""
    m = p + m_extra
    f, i, w = [t_f] * p, [t_i] * p, [t_w] * p
    b = [t_i + t_w] * p
    zb = pipeline_step("zb-h1", m, f, b, zeros(p), zeros(p), input_s=i, weight_s=w)
    for busy in zb.busy:
        assert zb.makespan - busy == pytest.approx(zb_h1_idle_time(p, t_f, t_i, t_w))
    one = pipeline_step("1f1b", m, f, b, zeros(p), zeros(p))
    for busy in one.busy:
        assert one.makespan - busy == pytest.approx(one_f_one_b_idle_time(p, t_f, t_i, t_w))


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m_extra", [0, 1, 4])
def test_zbv_idles_p_minus_one_chunk_steps(p: int, m_extra: int) -> None:
    """ZBV with F = I = W one unit per chunk and m >= 2p - 1: p - 1 idle units per rank
    (`zbv_idle_steps`), a ratio (p - 1) / (6 m)."""
    m, stages = 2 * p - 1 + m_extra, 2 * p
    ones = [1.0] * stages
    t = pipeline_step(
        "zbv", m, ones, [2.0] * stages, zeros(stages), zeros(stages), input_s=ones, weight_s=ones
    )
    for busy in t.busy:
        assert t.makespan - busy == pytest.approx(zbv_idle_steps(p))
    assert t.bubble / max(t.busy) == pytest.approx((p - 1) / (6 * m))


def test_a_local_hand_off_is_free_and_a_message_is_not() -> None:
    """ZBV on two ranks: stages 1 and 2 share rank 1 (the V's tip), so their activations and
    gradient never go on the wire ([Note: local hand-off]); stage 0's to stage 1 do."""
    m, stages = 4, 4
    ones = [1.0] * stages
    kw = {"input_s": ones, "weight_s": ones}

    def span(send_f: list[float], send_b: list[float]) -> float:
        return pipeline_step("zbv", m, ones, [2.0] * stages, send_f, send_b, **kw).makespan

    free = span(zeros(stages), zeros(stages))
    assert span([0.0, 100.0, 0.0, 0.0], [0.0, 0.0, 100.0, 0.0]) == pytest.approx(free)
    assert span([0.5, 0.0, 0.0, 0.0], zeros(stages)) > free + 0.5 - 1e-9


@pytest.mark.parametrize(
    ("schedule", "v", "p", "m"),
    [
        ("interleaved-1f1b", 2, 2, 4),
        ("interleaved-1f1b", 3, 3, 6),
        ("zb-h1", 1, 3, 5),
        ("zbv", 1, 3, 7),
    ],
)
def test_shared_core_simulation_at_full_speed_is_the_plain_one(
    schedule: str, v: int, p: int, m: int
) -> None:
    """[Note: shared-core simulation] with every speed 1 is the per-rank simulation for
    several stages per rank and a split backward too, uneven stages and messages included."""
    program, stage_map = lowered_program(schedule, p, m, v)
    n = stage_map.num_stages
    fwd = [1.0 + 0.1 * s for s in range(n)]
    bwd = [2.0 + 0.15 * s for s in range(n)]
    kw = {"stage_map": stage_map, "input_s": [1.1] * n, "weight_s": [0.9] * n}
    args = (program, fwd, bwd, [0.1] * n, [0.05] * n)
    span, busy = simulate_program(*args, **kw)
    for fixed in (None, [0.3] * n):
        shared_span, shared_busy = simulate_shared(*args, [1.0] * (p + 1), fixed, **kw)
        assert shared_span == pytest.approx(span)
        assert shared_busy == pytest.approx(busy)


def test_a_split_backward_needs_both_halves() -> None:
    with pytest.raises(PlanError, match="pass input_s and weight_s"):
        pipeline_step("zb-h1", 4, [1.0] * 2, [2.0] * 2, zeros(2), zeros(2))


# --- the split of a backward ------------------------------------------------------------------


def test_weight_gradient_share() -> None:
    """[Note: splitting a backward]: a Linear's dW is half its backward; attention adds to I
    only; unknown shapes take the paper's T_B = T_W."""
    assert weight_grad_share(equal_blocks(1).blocks[0]) == pytest.approx(0.5)
    for t, c in ((256, 256), (1536, 256)):
        layer = gpt_stats(n_layer=1, n_embd=c, n_head=4, block_size=t, vocab_size=64).blocks[1]
        assert weight_grad_share(layer) == pytest.approx(1 / (2 * (1 + t / (6 * c))))
    bare = BlockStats("b", 1, 4, 1e6, 0.0, 0.0)
    assert weight_grad_share(bare) == 0.5


# --- layouts priced end to end ----------------------------------------------------------------

P, M = 4, 8
EQUAL = equal_blocks(24)
ENV = Env(parse_cluster("1x8xA100-40GB"))
ONE_F_ONE_B = Layout(pp=P, microbatches=M)
INTERLEAVED = Layout(pp=P, schedule="interleaved-1f1b", virtual_stages=2, microbatches=M)
ZB_H1 = Layout(pp=P, schedule="zb-h1", microbatches=M)
ZBV = Layout(pp=P, schedule="zbv", microbatches=M)


@pytest.mark.parametrize(
    ("layout", "ratio"),
    [
        (ONE_F_ONE_B, (P - 1) / M),
        (INTERLEAVED, interleaved_bubble_ratio(P, M, 2)),
        (replace(INTERLEAVED, virtual_stages=3), interleaved_bubble_ratio(P, M, 3)),
        (ZB_H1, (P - 1) / (3 * M)),  # zb_h1_idle_time with F = I = W over 3 m of them
        (ZBV, zbv_idle_steps(P) / (6 * M)),
    ],
)
def test_predicted_bubble_is_the_formula(layout: Layout, ratio: float) -> None:
    """Equal one-Linear blocks (B = 2F, I = W = F), free messages, one device per stage: the
    predicted bubble over the busiest rank's compute is the schedule's formula."""
    pred = predict(layout, EQUAL, ENV, 64)
    assert pred.breakdown["bubble"] / pred.breakdown["compute"] == pytest.approx(ratio)


def test_interleaved_is_faster_and_larger_zero_bubble_as_large_as_1f1b() -> None:
    """Same p, m and blocks, free messages: interleaved 1F1B and both zero-bubble schedules
    step faster than 1F1B; interleaved holds more activations (rank 0: v p + p - 1 chunks),
    ZB-H1 and ZBV exactly 1F1B's p stages' worth."""
    one, inter, zb, zbv = (
        predict(lay, EQUAL, ENV, 64) for lay in (ONE_F_ONE_B, INTERLEAVED, ZB_H1, ZBV)
    )
    assert inter.step_s < one.step_s and zb.step_s < one.step_s and zbv.step_s < zb.step_s
    assert inter.memory_per_rank > one.memory_per_rank
    assert zb.memory_per_rank == pytest.approx(one.memory_per_rank)
    assert zbv.memory_per_rank == pytest.approx(one.memory_per_rank)
    # the activations themselves: the schedule's peak in chunks x one chunk's bytes
    mb = 64 / M
    stages = balanced_stages(EQUAL.blocks, P * 2)
    chunk = sum(b.saved_bytes for b in stages[0]) * mb
    mem = memory_per_rank(EQUAL, INTERLEAVED, stages, mb)
    assert mem.activations == pytest.approx(interleaved_peak_activations(0, P, M, 2) * chunk)
    assert mem.activations == pytest.approx(P * (1 + (P - 1) / (P * 2)) * 2 * chunk)


def test_the_plan_runs_what_was_priced() -> None:
    """`pipeline.virtual_stages` appears only where a rank holds several chunks; the partition
    counts blocks per virtual stage, in model order."""
    inter = predict(INTERLEAVED, EQUAL, ENV, 64).layout
    assert inter.describe() == "pp4-interleaved-1f1b-v2-m8"
    out = inter.overrides()
    assert out["pipeline.schedule"] == "interleaved-1f1b"
    assert out["pipeline.virtual_stages"] == 2
    assert out["pipeline.partition"] == [3] * 8
    for layout in (ONE_F_ONE_B, ZB_H1, ZBV):
        assert "pipeline.virtual_stages" not in predict(layout, EQUAL, ENV, 64).layout.overrides()
    assert predict(ZBV, EQUAL, ENV, 64).layout.partition == (3,) * 8


def test_new_schedules_pay_the_runtimes_per_action_seconds() -> None:
    """A calibrated CPU profile has no figure for schedules the runtime does not run: they take
    1F1B's per compute action (interleaved 2 v m of them per rank, ZB-H1 3 m, ZBV 6 m)."""
    profile = load_profile(ROOT / "benchmarks/planner/profile.json")
    env = Env(parse_cluster("1x2xcpu"), profile=profile)
    action, flush = profile.pipe_action_s["1f1b"], profile.pipe_flush_s["1f1b"]
    m = 4
    for layout, actions in (
        (Layout(pp=2, microbatches=m), 2 * m),
        (Layout(pp=2, schedule="interleaved-1f1b", virtual_stages=2, microbatches=m), 4 * m),
        (Layout(pp=2, schedule="zb-h1", microbatches=m), 3 * m),
        (Layout(pp=2, schedule="zbv", microbatches=m), 6 * m),
    ):
        pred = predict(layout, EQUAL, env, 8)
        assert pred.breakdown["pipeline_runtime"] == pytest.approx(action * actions + flush)


def test_by_rank_groups_each_ranks_stages() -> None:
    _, v_map = lowered_program("zbv", 2, 3)
    assert by_rank([["a"], ["b"], ["c"], ["d"]], v_map) == [["a", "d"], ["b", "c"]]
    with pytest.raises(PlanError, match="3 stages"):
        by_rank([["a"], ["b"], ["c"]], v_map)


# --- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "blocks", "match"),
    [
        (replace(INTERLEAVED, microbatches=6), 24, "multiple of 4, not 6: use 8 or 4"),
        (INTERLEAVED, 6, "runs 8 stages and the model has 6 blocks"),
        (ZBV, 6, "runs 8 stages and the model has 6 blocks"),
        (replace(ZB_H1, virtual_stages=2), 24, "only interleaved-1f1b takes"),
        (replace(ONE_F_ONE_B, schedule="zb-h2"), 24, "unknown pipeline schedule 'zb-h2'"),
    ],
)
def test_what_a_schedule_cannot_run_is_refused_in_one_line(
    layout: Layout, blocks: int, match: str
) -> None:
    assert pipeline_problem(layout, blocks) is not None
    with pytest.raises(PlanError, match=match) as err:
        predict(layout, equal_blocks(blocks), ENV, 64)
    assert "\n" not in str(err.value)


def test_one_stage_per_rank_schedules_need_no_even_split() -> None:
    assert pipeline_problem(replace(ZB_H1, microbatches=6), 13) is None
    assert pipeline_problem(replace(ONE_F_ONE_B, microbatches=6), 13) is None


def test_the_search_offers_the_new_schedules_only_when_asked_and_runnable() -> None:
    cluster = parse_cluster("1x8xA100-40GB")
    plain = list(enumerate_layouts(8, EQUAL, cluster, 64))
    assert {lay.schedule for lay in plain if lay.pp > 1} == {"gpipe", "1f1b", "pipedream"}
    offered = list(enumerate_layouts(8, EQUAL, cluster, 64, next_schedules=True))
    new = [lay for lay in offered if lay.schedule not in ("gpipe", "1f1b", "pipedream")]
    assert {(lay.schedule, lay.virtual_stages) for lay in new} == {
        ("interleaved-1f1b", 2),
        ("zb-h1", 1),
        ("zbv", 1),
    }
    assert set(plain) <= set(offered)
    for lay in new:
        assert pipeline_problem(lay, 24) is None
        predict(lay, EQUAL, Env(cluster.with_size(8)), 64)  # priced without error
    # 10 blocks: 2 stages per rank fit pp 2 and 4 (uneven counts balanced), not pp 8
    ten = list(enumerate_layouts(8, equal_blocks(10), cluster, 64, next_schedules=True))
    two_per_rank = [lay for lay in ten if lay.schedule in ("interleaved-1f1b", "zbv")]
    assert two_per_rank and all(lay.pp <= 4 for lay in two_per_rank)
    assert [lay for lay in ten if lay.schedule == "zb-h1" and lay.pp == 8]
    # a user's one-module model (its layer pipeline, pipeline.layer_stage): the same offer,
    # cut from its layers (here 10 of them, the whole model one block)
    layered = replace(EQUAL, blocks=EQUAL.blocks[:1], layer_blocks=equal_blocks(10).blocks)
    offered = list(enumerate_layouts(8, layered, cluster, 64, next_schedules=True))
    assert {(lay.schedule, lay.pp) for lay in offered if lay.schedule == "zbv"} == {
        ("zbv", 2),
        ("zbv", 4),
    }
    for lay in offered:
        if lay.schedule == "zbv":
            predict(lay, layered, Env(cluster.with_size(8)), 64)  # priced on the layers


# --- the schedules priced before virtual stages keep their figures ----------------------------

# (cluster, layout, global batch) -> (step_s, memory_per_rank, bubble) as the code before
# interleaved and zero-bubble pricing (commit 54538a0) computed them
GPT = gpt_stats(n_layer=8, n_embd=256, n_head=4, block_size=64, vocab_size=256)
PINNED = [
    ("gpu", Layout(pp=4, microbatches=8), 32, 0.0030501000931012143, 77685555.2, 0.0008976952855226832),
    ("gpu", Layout(pp=4, schedule="gpipe", microbatches=8), 32, 0.002972998693495691, 130464153.60000001, 0.00082059388591716),
    ("gpu", Layout(dp=2, pp=4, microbatches=4, recompute=True), 32, 0.0029456622231209375, 40631500.800000004, 0.0010929998832347146),
    ("gpu", Layout(tp=2, pp=2, microbatches=4), 16, 0.0028383821555108225, 58707968.00000001, 0.0005814962619329392),
    ("gpu", Layout(pp=2, schedule="pipedream", microbatches=4), 16, 0.0021447774714567136, 118015180.80000001, 3.084055984221021e-05),
    ("cpu", Layout(pp=4, microbatches=8), 32, 1.563105037551648, 77685555.2, 0.26889888608676404),
    ("cpu", Layout(pp=2, schedule="gpipe", microbatches=4), 16, 1.5171542811668726, 152496537.60000002, 0.17676217549708562),
    ("cpu", Layout(pp=2, schedule="pipedream", microbatches=8), 16, 1.5258885933228552, 94658150.4, 0.09108525346255214),
]  # fmt: skip


@pytest.mark.parametrize(("where", "layout", "batch", "step", "memory", "bubble"), PINNED)
def test_old_schedules_keep_their_prices(
    where: str, layout: Layout, batch: int, step: float, memory: float, bubble: float
) -> None:
    if where == "gpu":
        env = Env(parse_cluster("2x4xA100-40GB:ib200"))
    else:
        profile = load_profile(ROOT / "benchmarks/planner/profile.json")
        env = Env(parse_cluster("1x4xcpu"), profile=profile)
    pred = predict(layout, GPT, env, batch)
    assert pred.step_s == pytest.approx(step, rel=1e-12)
    assert pred.memory_per_rank == pytest.approx(memory, rel=1e-12)
    assert pred.breakdown["bubble"] == pytest.approx(bubble, rel=1e-12, abs=1e-15)


def test_the_wrap_around_message_takes_its_own_link_when_the_pipeline_leaves_a_host() -> None:
    """[Note: a message's link]: interleaved 1F1B's last rank sends back to rank 0, p - 1
    pipeline ranks away; inside one host that is the neighbours' link, across hosts its own.
    Stages on one rank exchange nothing (ZBV's tip)."""
    from polytrain.planner.cost.stages import _message_s

    nbytes = 1e8
    _, loop = lowered_program("interleaved-1f1b", 4, 4, 2)
    one_host = Env(parse_cluster("1x4xA100-40GB"))
    two_hosts = Env(parse_cluster("2x2xA100-40GB:ib200"))
    for env in (one_host, two_hosts):
        assert _message_s(env, INTERLEAVED, loop, 0, 1, nbytes) == env.posted_p2p_s(nbytes, 1)
    assert _message_s(one_host, INTERLEAVED, loop, 3, 4, nbytes) == one_host.posted_p2p_s(nbytes, 1)
    wrap = _message_s(two_hosts, INTERLEAVED, loop, 3, 4, nbytes)
    assert wrap == two_hosts.posted_p2p_s(nbytes, 3) > two_hosts.posted_p2p_s(nbytes, 1)
    _, v_map = lowered_program("zbv", 4, 4)
    assert _message_s(one_host, ZBV, v_map, 3, 4, nbytes) == 0.0  # both on rank 3


def test_zb_h1_holds_p_micro_batches_on_the_last_stage_too() -> None:
    """Every ZB-H1 rank holds p micro-batches until their W, the last one too, where 1F1B's last
    stage holds one: a model whose last stage saves the most (a gpt's logits) needs more."""
    one = predict(Layout(pp=4, microbatches=8), GPT, ENV, 32)
    zb = predict(Layout(pp=4, schedule="zb-h1", microbatches=8), GPT, ENV, 32)
    assert zb.memory_per_rank > one.memory_per_rank

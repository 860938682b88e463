"""The planner's ZeRO inside pipeline stages ([Note: ZeRO inside stages] in
pipeline/sharded.py): memory by kind, the collectives each schedule makes, and a search that
offers these layouts exactly where the runtime's pre-flight accepts them."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from polytrain.config.io import job_from_dict
from polytrain.errors import ConfigError
from polytrain.pipeline.checks import check_pipeline_job
from polytrain.pipeline.schedule import ActionKind
from polytrain.planner.cluster import parse_cluster
from polytrain.planner.cost import Env, predict
from polytrain.planner.cost.pipeline import pipeline_step
from polytrain.planner.memory import memory_per_rank
from polytrain.planner.partition import balanced_stages
from polytrain.planner.search import enumerate_layouts
from polytrain.planner.types import Layout, ModelStats
from polytrain.trainer.auto import apply_layout
from tests.helpers import planner as planner_helpers
from tests.helpers.cli import assert_usage_error, run_main

C, T = 512, 64
BATCH = 16


def equal_blocks(n: int) -> ModelStats:
    """``n`` identical one-Linear blocks (AdamW: two states a parameter)."""
    return planner_helpers.equal_blocks(n, C, T, output_bytes=4.0 * T * C)


STATS = equal_blocks(8)
BLOCK = float(STATS.blocks[0].param_bytes)
STAGE = 4 * BLOCK  # pp = 2 over 8 equal blocks
ZERO0 = Layout(dp=2, pp=2, schedule="1f1b", microbatches=4)


def _memory(layout: Layout) -> dict[str, float]:
    stages = balanced_stages(STATS.blocks, 2 * layout.virtual_stages)
    mb = BATCH / layout.dp / (layout.microbatches * layout.grad_accum)
    return memory_per_rank(STATS, layout, stages, mb).as_dict()


def test_zero_stages_shard_what_the_runtime_shards() -> None:
    """dp2 x pp2: ZeRO-3 holds half a stage's weights and optimizer state, the whole gradient
    it accumulates over the step's micro-batches, and two blocks gathered (the one running and
    the one prefetched); ZeRO-2 the whole stage gathered through the step instead."""
    plain = _memory(ZERO0)
    z3 = _memory(replace(ZERO0, zero=3))
    z2 = _memory(replace(ZERO0, zero=2))
    assert plain["weights"] == STAGE and plain["grads"] == STAGE
    assert plain["optimizer"] == 2 * STAGE
    assert z3["weights"] == STAGE / 2 and z3["optimizer"] == STAGE
    assert z3["grads"] == STAGE  # every backward but the step's last accumulates unsharded
    assert z3["activations"] == plain["activations"]
    assert z3["buffers"] - plain["buffers"] == 2 * BLOCK
    assert plain["total"] - z3["total"] == pytest.approx(1.1 * (STAGE / 2 + STAGE - 2 * BLOCK))
    assert z2["weights"] == STAGE / 2 and z2["optimizer"] == STAGE and z2["grads"] == STAGE
    assert z2["buffers"] - plain["buffers"] == STAGE
    # one backward per step (GPipe, one micro-batch): it reduces at once, only the shard stays
    one = replace(ZERO0, zero=3, schedule="gpipe", microbatches=1)
    assert _memory(one)["grads"] == STAGE / 2
    # interleaved 1F1B: a rank's two stages, each its own FSDP2 root, both sharded
    inter = replace(ZERO0, schedule="interleaved-1f1b", virtual_stages=2)
    assert _memory(replace(inter, zero=3))["weights"] == _memory(inter)["weights"] / 2


def _comm(layout: Layout, cluster: str = "1x4xcpu") -> tuple[float, Env]:
    env = Env(parse_cluster(cluster))
    return predict(layout, STATS, env, BATCH).breakdown["dp_comm"], env


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b"])
@pytest.mark.parametrize("accum", [1, 2])
def test_each_collective_is_priced_as_often_as_the_runtime_makes_it(
    schedule: str, accum: int
) -> None:
    """On a CPU host nothing overlaps ([Note: FSDP2 on a CPU host]): a rank's exposed
    collectives are, per block it holds, ZeRO-3's two gathers a micro-batch in every run of the
    program and ZeRO-2's one gather a step, and one reduce-scatter a step; no all-reduce."""
    v = 2 if schedule == "interleaved-1f1b" else 1
    base = replace(ZERO0, schedule=schedule, virtual_stages=v, grad_accum=accum)
    dp_s, env = _comm(base)
    gather = env.collective_s("all_gather", BLOCK, 2)
    scatter = env.collective_s("reduce_scatter", BLOCK, 2)
    assert dp_s == pytest.approx(env.collective_s("all_reduce", STAGE, 2))
    m, blocks = base.microbatches, 4  # a rank's blocks, over all its stages
    z3, _ = _comm(replace(base, zero=3))
    z2, _ = _comm(replace(base, zero=2))
    assert z3 == pytest.approx(blocks * (2 * m * accum * gather + scatter))
    assert z2 == pytest.approx(blocks * (gather + scatter))


def test_an_accelerator_hides_most_of_them() -> None:
    """On an accelerator FSDP2's collectives run beside the compute (prefetch depth one), as
    `cost.zero.zero_step` prices them at pp = 1: less is exposed than their sum."""
    layout = replace(ZERO0, zero=3)
    exposed, env = _comm(layout, "1x4xH100")
    gather = env.collective_s("all_gather", BLOCK, 2)
    scatter = env.collective_s("reduce_scatter", BLOCK, 2)
    assert 0 < exposed < 4 * (2 * layout.microbatches * gather + scatter)


def test_once_a_step_collectives_delay_the_whole_pipeline() -> None:
    """GPipe, two stages, free messages: a gather in each stage's first forward and a
    reduce-scatter in its last backward lie on the one critical path (fill through both
    stages, drain back through both), so the step grows by all four, not by the largest."""
    f, b, m = [1.0, 1.0], [2.0, 2.0], 4
    plain = pipeline_step("gpipe", m, f, b, [0.0, 0.0], [0.0, 0.0]).per_step
    comm = {
        (ActionKind.F, 0, 0): 0.1,
        (ActionKind.F, 1, 0): 0.2,
        (ActionKind.B, 1, m - 1): 0.3,
        (ActionKind.B, 0, m - 1): 0.4,
    }
    timed = pipeline_step("gpipe", m, f, b, [0.0, 0.0], [0.0, 0.0], comm_s=comm).per_step
    assert timed - plain == pytest.approx(1.0)


def _runtime_refusal(layout: Layout) -> str | None:
    """The runtime's pre-flight on the job the planner would write for ``layout``."""
    job = apply_layout(job_from_dict({}), layout)
    try:
        check_pipeline_job(job)
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("devices", [4, 8])
def test_the_search_offers_zero_stages_exactly_where_the_runtime_runs_them(devices: int) -> None:
    """Every mesh, schedule and micro-batch count the search offers at ZeRO 0: its ZeRO-2 and
    ZeRO-3 twins are offered iff the runtime's pre-flight accepts them (pipedream, ZB-H1, ZBV
    and tensor-parallel stages refused), and every pipeline it offers passes the pre-flight."""
    cluster = parse_cluster(f"1x{devices}xH100")
    offered = {
        lay
        for lay in enumerate_layouts(devices, STATS, cluster, BATCH, next_schedules=True)
        if lay.pp > 1 and not lay.recompute
    }
    assert any(lay.zero for lay in offered)
    for lay in offered:
        assert _runtime_refusal(lay) is None, lay.describe()
    checked = set()
    for lay in (lay for lay in offered if lay.zero == 0 and lay.dp > 1):
        for zero in (2, 3):
            twin = replace(lay, zero=zero)
            accepted = _runtime_refusal(twin) is None
            assert (twin in offered) == accepted, (twin.describe(), _runtime_refusal(twin))
            checked.add((lay.schedule, lay.tp > 1, accepted))
    schedules = {s for s, _, ok in checked if ok}
    assert schedules == {"gpipe", "1f1b", "interleaved-1f1b"}
    assert {s for s, _, ok in checked if not ok} >= {"pipedream", "zb-h1", "zbv"}
    if devices == 8:  # dp2 x tp2 x pp2: tensor-parallel stages refused with ZeRO
        assert (("1f1b", True, False)) in checked


def test_plan_prices_a_given_zero_stages_layout(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--model", "gpt", "--size", "medium", "--cluster", "1x8xH100", "--json"]
    parts = {}
    for zero in (0, 3):
        code, out, _ = run_main([*base, "--layout", f"dp=2,pp=2,zero={zero},micro=4"], capsys)
        assert code == 0
        data = json.loads(out)
        parts[zero] = data["breakdown"]
    assert data["layout"] == "dp2-pp2-1f1b-m4-zero3" and data["devices"] == 4
    assert parts[3]["memory_weights"] == pytest.approx(parts[0]["memory_weights"] / 2)
    assert parts[3]["memory_optimizer"] == pytest.approx(parts[0]["memory_optimizer"] / 2)
    assert parts[3]["memory_buffers"] > parts[0]["memory_buffers"]
    assert parts[3]["dp_comm"] > 0 and parts[3]["memory_total"] < parts[0]["memory_total"]
    # what the runtime refuses is refused in its words, one line
    code, _, err = run_main([*base, "--layout", "dp=2,pp=2,zero=3,micro=4,schedule=zbv"], capsys)
    assert_usage_error(code, err, "parallel.zero = 3 with pipeline.schedule = 'zbv'")
    code, _, err = run_main([*base, "--layout", "dp=2,tp=2,pp=2,zero=2,micro=4"], capsys)
    assert_usage_error(code, err, "ZeRO stages are not tensor-parallel")


def test_tensor_parallel_zero_stages_reduce_after_the_flush() -> None:
    """[Note: tensor-parallel ZeRO stages]: the runtime refuses them, and the published runs
    that had them (DeepSpeed's ZeRO-1 in BLOOM) reduce after the flush, every stage at once:
    the pipeline's all-reduce of the rank's tp shard over its dp peers, nothing in the actions."""
    layout = Layout(dp=2, tp=2, pp=2, zero=2, schedule="1f1b", microbatches=4)
    dp_s, env = _comm(layout, "1x8xH100")
    assert dp_s == pytest.approx(env.collective_s("all_reduce", STAGE / 2, 2, 2))
    assert predict(layout, STATS, env, BATCH).breakdown["fsdp_hooks"] == 0.0

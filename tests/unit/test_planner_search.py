"""Search and ranking (pure)."""

from __future__ import annotations

import pytest

from polytrain.errors import PlanError
from polytrain.planner.cluster import parse_cluster
from polytrain.planner.cost import Env, predict
from polytrain.planner.partition import balanced_stages
from polytrain.planner.search import PlanRequest, device_counts, enumerate_layouts, search
from polytrain.planner.stats_pure import gpt_stats
from polytrain.planner.types import BlockStats, Layout, ModelStats, launch_shape

SMALL = gpt_stats(n_layer=8, n_embd=512, n_head=8, block_size=256, vocab_size=100)


def test_device_counts_are_powers_of_two_hosts_and_ends() -> None:
    c = parse_cluster("3x4xA100-40GB:ib200")
    assert device_counts(c, 1, 0) == [1, 2, 4, 8, 12]
    assert device_counts(c, 3, 6) == [3, 4, 6]
    with pytest.raises(PlanError, match="has 12"):
        device_counts(c, 1, 16)


def test_layouts_respect_the_runtime_rules() -> None:
    c = parse_cluster("2x4xA100-40GB:ib200")
    layouts = list(enumerate_layouts(8, SMALL, c, 32))
    assert all(lay.devices == 8 for lay in layouts)
    assert all(lay.tp in (1, 2, 4) for lay in layouts)  # tp tiles a host of 4
    three_heads = gpt_stats(n_layer=2, n_embd=96, n_head=3, block_size=16, vocab_size=10)
    assert {lay.tp for lay in enumerate_layouts(4, three_heads, c, 8)} == {1}
    assert not any(lay.schedule == "pipedream" and lay.tp > 1 and lay.pp > 1 for lay in layouts)
    # ZeRO inside stages: gpipe and 1f1b over dp peers, never tensor-parallel or PipeDream
    # (tests/unit/test_planner_zero_stages.py holds the whole grid against the pre-flight)
    staged = [lay for lay in layouts if lay.zero and lay.pp > 1]
    assert staged and all(lay.dp > 1 and lay.tp == 1 for lay in staged)
    assert {lay.schedule for lay in staged} == {"gpipe", "1f1b"}
    # parameter servers: 4 workers + 1 server divide the batch of 32, 3 + 2 do not
    assert not any(lay.sync == "ps" for lay in layouts)  # the runtime refuses PS on CUDA
    cpu = parse_cluster("1x8xcpu")
    ps = [lay for lay in enumerate_layouts(5, SMALL, cpu, 32) if lay.sync == "ps"]
    assert {(lay.dp, lay.ps_servers) for lay in ps} == {(4, 1)}
    assert {lay.ps_mode for lay in ps} == {"sync", "async", "ssp"}


def test_time_objective_takes_the_fastest_and_cost_the_cheapest() -> None:
    cluster = parse_cluster("1x8xA100-40GB")
    fast = search(PlanRequest(SMALL, cluster, 64, 100, objective="time"))
    cheap = search(PlanRequest(SMALL, cluster, 64, 100, objective="cost"))
    assert fast.best is not None and cheap.best is not None
    times = [p.total_s for p in fast.plans if p.meets]
    assert fast.best.total_s == min(times)
    costs = [round(p.cost or 0, 2) for p in cheap.plans if p.meets]
    assert round(cheap.best.cost or 0, 2) == min(costs)
    assert fast.best.devices == 8  # this model scales well on NVLink
    assert all(p.why for p in fast.plans[1:])  # every runner-up says why it lost


def test_synchronous_by_default() -> None:
    res = search(PlanRequest(SMALL, parse_cluster("1x4xcpu"), 32, 10))
    assert not any(p.layout.schedule == "pipedream" and p.layout.pp > 1 for p in res.plans)
    assert not any(p.layout.ps_mode != "sync" for p in res.plans)
    assert any(p.layout.sync == "ps" for p in res.plans)
    res = search(PlanRequest(SMALL, parse_cluster("1x4xcpu"), 32, 10, allow_async=True))
    assert any(p.layout.ps_mode == "async" for p in res.plans)
    assert any(p.layout.schedule == "pipedream" and p.layout.pp > 1 for p in res.plans)


def test_budget_nothing_meets_gives_cheapest_and_fastest() -> None:
    req = PlanRequest(
        SMALL, parse_cluster("4x8xH100:ib400"), 32, 1200, budget=0.001, deadline_s=7200
    )
    res = search(req)
    assert res.best is None
    assert "no layout meets a budget of $0.00" in res.note
    assert set(res.extremes) == {"cheapest", "fastest"}
    assert res.extremes["fastest"].total_s <= res.extremes["cheapest"].total_s


def test_deadline_picks_the_cheapest_that_finishes_in_time() -> None:
    cluster = parse_cluster("1x8xA100-40GB")
    free = search(PlanRequest(SMALL, cluster, 64, 100_000, objective="cost"))
    assert free.best is not None
    deadline = free.best.total_s / 3  # the cheapest is too slow now
    res = search(PlanRequest(SMALL, cluster, 64, 100_000, deadline_s=deadline))
    assert res.objective == "cost"
    assert res.best is not None and res.best.total_s <= deadline


def test_a_model_too_big_for_one_device_is_split_automatically() -> None:
    # ~1.6 B parameters in fp32 with AdamW: ~26 GB of model states, more than one L4 (24 GiB)
    big = gpt_stats(n_layer=24, n_embd=2304, n_head=24, block_size=1024, vocab_size=50257)
    res = search(PlanRequest(big, parse_cluster("1x8xL4"), 8, 10))
    assert all(not p.prediction.fits for p in res.plans if p.devices == 1)
    assert res.best is not None
    lay = res.best.layout
    assert lay.tp > 1 or lay.pp > 1 or lay.zero >= 2


def test_a_model_that_fits_nowhere_says_what_would_fit() -> None:
    huge = gpt_stats(n_layer=96, n_embd=12288, n_head=96, block_size=2048, vocab_size=51200)
    res = search(PlanRequest(huge, parse_cluster("1x2xL4"), 8, 10))
    assert res.best is None and not res.extremes
    assert "fits no layout" in res.note and "would fit: about" in res.note


def test_a_layout_that_does_not_fit_is_not_timed() -> None:
    """[Note: untimed layouts]: memory only, an infinite step, and nothing that depends on
    its time; the same layout priced on its own is timed as before."""
    big = gpt_stats(n_layer=24, n_embd=2304, n_head=24, block_size=1024, vocab_size=50257)
    res = search(PlanRequest(big, parse_cluster("1x8xL4"), 8, 10))
    unfit = [p for p in res.plans if not p.prediction.fits]
    assert unfit and all(p.prediction.step_s == float("inf") for p in unfit)
    assert all("out of memory" in p.why and not p.meets for p in unfit)
    env = Env(parse_cluster("1x1xL4"))
    assert 0 < predict(Layout(), big, env, 8).step_s < float("inf")


def test_pipelines_get_every_micro_batch_count_and_partial_recomputation() -> None:
    """[Note: micro-batch counts]: m >= pp dividing the replica's batch, 12 pp included;
    every:2 recomputation beside none and full."""
    c = parse_cluster("1x8xA100-40GB")
    pipes = [lay for lay in enumerate_layouts(8, SMALL, c, 96) if lay.pp == 8]
    assert {lay.microbatches for lay in pipes} == {8, 12, 16, 24, 32, 48, 96}
    variants = {(lay.recompute, lay.recompute_every) for lay in pipes}
    assert variants == {(False, 1), (True, 2), (True, 1)}


def test_cost_needs_a_price() -> None:
    with pytest.raises(PlanError, match="no price for M40"):
        search(PlanRequest(SMALL, parse_cluster("1x2xM40"), 8, 10, budget=5.0))


def test_late_multiply_is_offered_only_where_a_layer_gains() -> None:
    # an MLP on 2 samples per replica: factors (2 rows) are far smaller than 2048 x 2048
    from polytrain.planner.stats_pure import mlp_stats

    wide = mlp_stats(n_layer=4, n_embd=2048, block_size=32, vocab_size=65)
    res = search(PlanRequest(wide, parse_cluster("2x1xV100:eth10"), 4, 10))
    assert any(p.layout.sufficient_factor for p in res.plans)
    # a GPT sees batch x tokens rows per Linear: the dense all-reduce wins, so no sf layout
    res = search(PlanRequest(SMALL, parse_cluster("1x4xA100-40GB"), 32, 10))
    assert not any(p.layout.sufficient_factor for p in res.plans)


def test_overrides_launch_a_multi_host_layout_per_node() -> None:
    """`Layout.overrides`: nproc is per node, not the total; uneven counts are refused and the
    search does not offer them; a pipeline carries the partition it was priced with."""
    big = Layout(dp=16)
    assert big.overrides()["launch.nproc"] == 16  # one host (the default)
    fields = big.overrides(per_host=8)
    assert (fields["launch.nproc"], fields["launch.nnodes"]) == (8, 2)
    assert Layout(dp=6).overrides(per_host=4)["launch.nproc"] == 3  # 2 nodes x 3
    with pytest.raises(PlanError, match="no number of hosts of 4"):
        Layout(dp=5).overrides(per_host=4)
    assert launch_shape(5, 4) is None and launch_shape(3, 4) == (3, 1)
    assert device_counts(parse_cluster("2x4xA100-40GB:ib200"), 5, 5) == []
    pipe = Layout(pp=2, microbatches=2, partition=(1, 3))
    assert pipe.overrides()["pipeline.partition"] == [1, 3]
    assert "pipeline.partition" not in Layout(pp=2, microbatches=2).overrides()


def test_the_searched_pipeline_runs_the_partition_it_was_priced_with() -> None:
    stats = ModelStats(
        "skewed",
        tuple(
            BlockStats(f"blocks.{i}", 10, 40, f, 1.0, 4.0)
            for i, f in enumerate([1e9, 1e6, 1e6, 1e6])
        ),
    )
    pred = predict(Layout(pp=2, microbatches=2), stats, Env(parse_cluster("1x2xA100-40GB")), 8)
    assert pred.layout.partition == tuple(len(s) for s in balanced_stages(stats.blocks, 2))
    assert pred.layout.partition == (1, 3)


def test_leaf_servers_are_offered_across_hosts_and_win_on_a_slow_inter_host_link() -> None:
    """[Note: leaf servers] in ps/leaf.py: one leaf per host when the workers span hosts; the
    root then meets 4 leaves instead of 15 workers, which a 10 Gb/s link between hosts of a
    fast intra-host link rewards."""
    one_host = parse_cluster("1x8xcpu")
    assert not any(lay.ps_leaves for lay in enumerate_layouts(8, SMALL, one_host, 42))
    cluster = parse_cluster("4x4xcpu:eth10")
    layouts = [lay for lay in enumerate_layouts(16, SMALL, cluster, 210) if lay.sync == "ps"]
    leaves = [lay for lay in layouts if lay.ps_leaves]
    assert {(lay.dp, lay.ps_leaves) for lay in leaves} == {(15, 4), (14, 4)}
    env = Env(cluster)
    flat = Layout(dp=15, sync="ps", ps_servers=1, ps_mode="sync")
    leafy = Layout(dp=15, sync="ps", ps_servers=1, ps_mode="sync", ps_leaves=4)
    assert predict(leafy, SMALL, env, 210).step_s < predict(flat, SMALL, env, 210).step_s
    assert leafy.describe() == "ps-sync-w15-s1-l4"
    assert leafy.overrides(per_host=4)["ps.leaves"] == "host"  # 15 workers: hosts of 4, 4, 4, 3
    assert Layout(dp=8, sync="ps", ps_servers=1, ps_leaves=4).overrides()["ps.leaves"] == 4

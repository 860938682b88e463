"""Each cost family against numbers computed by hand (pure, milliseconds)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from polytrain.pipeline.schedule import bubble_fraction
from polytrain.planner.cluster import parse_cluster
from polytrain.planner.cost import Env, predict
from polytrain.planner.cost.dp import bucket_sizes, dp_backward
from polytrain.planner.cost.overlap import overlap
from polytrain.planner.cost.pipeline import (
    pipeline_step,
    program,
    simulate_program,
    simulate_shared,
)
from polytrain.planner.cost.ps import ps_step
from polytrain.planner.cost.rates import concurrent_rate
from polytrain.planner.cost.sufficient_factor import dense_s, sf_s
from polytrain.planner.cost.zero import zero_step
from polytrain.planner.stats_pure import gpt_stats
from polytrain.planner.types import BlockStats, Curve, HostProfile, Layout, ModelStats, TPModule

ENV = Env(parse_cluster("2x4xA100-40GB:ib200"))


def test_ring_all_reduce_alpha_beta() -> None:
    # inside a host: NVLink 3, 300 GB/s, 3.4 us per hop, 8.4 us base
    x, n = 1e9, 4
    expected = 2 * (n - 1) / n * x / 300e9 + 2 * (n - 1) * 3.4e-6 + 8.4e-6
    assert ENV.collective_s("all_reduce", x, n, 1) == pytest.approx(expected)
    # across hosts (stride 4 x 2 > 4 devices per host): InfiniBand HDR, 25 GB/s, 14 us per hop
    cross = 2 * 1 / 2 * x / 25e9 + 2 * 1 * 14e-6 + 8.4e-6
    assert ENV.collective_s("all_reduce", x, 2, 4) == pytest.approx(cross)
    gather = (n - 1) / n * x / 300e9 + (n - 1) * 3.4e-6 + 8.4e-6
    assert ENV.collective_s("all_gather", x, n, 1) == pytest.approx(gather)
    assert ENV.collective_s("all_reduce", x, 1, 1) == 0.0


def test_two_stream_overlap_hides_communication_behind_compute() -> None:
    # three 1 s backward blocks, each emitting 0.5 s of all-reduce: only the last is exposed
    end, exposed = overlap([1.0, 1.0, 1.0], after=[0.5, 0.5, 0.5])
    assert (end, exposed) == (pytest.approx(3.5), pytest.approx(0.5))
    # communication longer than compute: 0.5 s exposed per block after the first... 2 s each
    end, exposed = overlap([1.0, 1.0], after=[2.0, 2.0])
    assert end == pytest.approx(5.0)  # comm 1->3, 3->5
    # prefetched gathers: the first is exposed, the rest hide behind compute
    end, _ = overlap([1.0, 1.0, 1.0], before=[0.2, 0.2, 0.2])
    assert end == pytest.approx(3.2)


def test_ddp_buckets_and_exposed_all_reduce() -> None:
    assert bucket_sizes([30.0, 30.0, 5.0], 25.0) == [[(1, 25.0)], [(1, 25.0)], [(1, 15.0)]]
    env = Env(parse_cluster("1x4xA100-40GB"), bucket_bytes=1e9)
    # one 1 GB bucket closes at the end of backward: fully exposed
    end, exposed = dp_backward(env, [0.01, 0.01], [5e8, 5e8], dp=4, stride=1)
    assert exposed == pytest.approx(env.collective_s("all_reduce", 1e9, 4, 1))
    assert end == pytest.approx(0.02 + exposed)


def test_zero3_moves_half_again_the_bytes_of_zero2() -> None:
    slow = Env(parse_cluster("2x1xA100-40GB:eth10"))  # communication dominates
    fwd, bwd, pb = [1e-6] * 4, [2e-6] * 4, [1e8] * 4
    _, _b2, e2 = zero_step(slow, 2, fwd, bwd, pb, dp=2, stride=1)
    _, _b3, e3 = zero_step(slow, 3, fwd, bwd, pb, dp=2, stride=1)
    one = slow.collective_s("all_gather", 1e8, 2, 1)
    assert e2 == pytest.approx(8 * one, rel=0.01)  # 4 gathers + 4 scatters
    assert e3 == pytest.approx(12 * one, rel=0.01)  # + 4 gathers again in backward
    _, _, quiet = zero_step(slow, 3, fwd, bwd, pb, dp=2, stride=1, scatter=False)
    assert quiet == pytest.approx(8 * one, rel=0.01)  # accumulation micro-step: no scatter


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(2, 1), (4, 4), (4, 8), (3, 7)])
def test_pipeline_simulation_has_the_known_bubble(schedule: str, p: int, m: int) -> None:
    f, b = 1.0, 2.0
    t = pipeline_step(schedule, m, [f] * p, [b] * p, [0.0] * p, [0.0] * p)
    assert t.makespan == pytest.approx((m + p - 1) * (f + b))
    idle = 1 - max(t.busy) / t.makespan
    assert idle == pytest.approx(bubble_fraction(p, m))


def test_pipeline_p2p_time_lengthens_the_fill() -> None:
    p, m, c = 4, 8, 0.1
    t0 = pipeline_step("gpipe", m, [1.0] * p, [2.0] * p, [0.0] * p, [0.0] * p)
    t1 = pipeline_step("gpipe", m, [1.0] * p, [2.0] * p, [c] * p, [c] * p)
    # GPipe: the first forward and the last backward each cross p - 1 links
    assert t1.makespan == pytest.approx(t0.makespan + 2 * (p - 1) * c)
    # 1F1B alternates F and B in steady state, so messages also sit on its critical path
    # there (Narayanan et al. 2021, sec. 2.2): at least GPipe's extra, and more
    f0 = pipeline_step("1f1b", m, [1.0] * p, [2.0] * p, [0.0] * p, [0.0] * p)
    f1 = pipeline_step("1f1b", m, [1.0] * p, [2.0] * p, [c] * p, [c] * p)
    assert f1.makespan > f0.makespan + 2 * (p - 1) * c


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pipedream"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 7), (4, 8), (4, 1)])
def test_shared_core_simulation_at_full_speed_is_the_plain_one(
    schedule: str, p: int, m: int
) -> None:
    """[Note: shared-core simulation]: with every speed 1 (no sharing) the global-clock
    simulation gives the per-rank one's makespan and busy seconds, uneven stages and p2p times
    included, and a fixed (waiting) part of each F and B changes nothing either."""
    fwd, bwd = [1.0, 1.3, 0.7, 1.1][:p], [2.0, 2.2, 1.9, 2.5][:p]
    args = (program(schedule, p, m), fwd, bwd, [0.1] * p, [0.05] * p)
    span, busy = simulate_program(*args)
    for fixed in (None, [0.3] * p):
        shared_span, shared_busy = simulate_shared(*args, [1.0] * (p + 1), fixed)
        assert shared_span == pytest.approx(span)
        assert shared_busy == pytest.approx(busy)


def test_shared_cores_speed_up_a_stage_computing_alone() -> None:
    """GPipe over two stages with one micro-batch: only one stage ever computes, so every F and
    B runs at the one-alone speed (twice the all-busy speed here): half the time. A fixed part
    of each action (the runtime's waits) is not sped up. PipeDream's steady state has both
    stages computing all the time: its per-step time stays at the all-busy price."""
    alone_twice = [1.0, 2.0, 1.0]  # speed[n] with n of the 2 stages computing
    one = ("gpipe", 1, [1.0] * 2, [1.0] * 2, [0.0] * 2, [0.0] * 2)
    assert pipeline_step(*one).makespan == pytest.approx(4.0)
    assert pipeline_step(*one, alone_twice).makespan == pytest.approx(2.0)
    assert pipeline_step(*one, alone_twice, [0.5] * 2).makespan == pytest.approx(4 * 0.75)
    stream = ("pipedream", 16, [1.0] * 2, [2.0] * 2, [0.0] * 2, [0.0] * 2)
    assert pipeline_step(*stream, alone_twice).per_step == pytest.approx(16 * 3.0)
    # its fill and drain, one stage alone, do run faster
    assert pipeline_step(*stream, alone_twice).makespan < pipeline_step(*stream).makespan


def test_pipedream_steady_state_has_no_bubble() -> None:
    p, m = 4, 8
    t = pipeline_step("pipedream", m, [1.0] * p, [2.0] * p, [0.0] * p, [0.0] * p)
    assert t.per_step == pytest.approx(m * 3.0)
    assert t.bubble == pytest.approx(0.0)


def test_parameter_server_is_bound_by_server_bandwidth() -> None:
    env = Env(parse_cluster("1x8xcpu"))
    link = env.link(1, 8)
    g = 1e8
    step, comm = ps_step(env, "sync", 7, 1, 0.5, g, g / 4, 2, 4)
    assert comm == pytest.approx(7 * g / link.bandwidth + 2 * link.latency, rel=1e-6)
    _step2, comm2 = ps_step(env, "sync", 6, 2, 0.5, g, g / 4, 2, 4)
    assert comm2 < comm / 2  # twice the servers, each taking 6/2 instead of 7 pushes
    # async: the global step is bound by the servers, not by compute + the worker's exchange
    a_step, _ = ps_step(env, "async", 7, 1, 0.01, g, g / 4, 2, 4)
    assert a_step < step and a_step >= comm


def test_sufficient_factor_wins_for_small_batches_and_loses_for_large() -> None:
    env = Env(parse_cluster("1x4xV100"))
    assert sf_s(env, 4096, 4096, rows=8, dp=4, dtype_bytes=4) < dense_s(env, 4096, 4096, 4, 4)
    assert sf_s(env, 4096, 4096, rows=8192, dp=4, dtype_bytes=4) > dense_s(env, 4096, 4096, 4, 4)


def test_tensor_parallel_pays_four_all_reduces_per_layer() -> None:
    stats = gpt_stats(n_layer=4, n_embd=1024, n_head=16, block_size=512, vocab_size=256)
    env = Env(parse_cluster("1x4xA100-40GB"))
    p1 = predict(Layout(dp=1, tp=4), stats, env, 8)
    layer = stats.blocks[1]
    one = env.collective_s("all_reduce", layer.output_bytes * 8, 4, 1)
    # 4 layers x (2 forward + 2 backward), and the embedding and the head 1 + 1 each, all
    # of the same (B, T, C) activation
    assert p1.breakdown["tp_comm"] == pytest.approx(20 * one)


def test_more_replicas_split_the_compute() -> None:
    stats = gpt_stats(n_layer=8, n_embd=512, n_head=8, block_size=256, vocab_size=100)
    env = Env(parse_cluster("1x8xA100-40GB"))
    one = predict(Layout(dp=1), stats, env, 64)
    eight = predict(Layout(dp=8), stats, env, 64)
    assert eight.breakdown["compute"] == pytest.approx(one.breakdown["compute"] / 8)
    assert one.step_s / eight.step_s > 6  # nearly linear over NVLink
    # the same compute with recomputation costs one more forward
    rec = predict(Layout(dp=1, recompute=True), stats, env, 64)
    assert rec.breakdown["compute"] == pytest.approx(one.breakdown["compute"] * 4 / 3, rel=1e-6)
    # every:2 recomputes the blocks with an even index only: between the two
    half = predict(Layout(dp=1, recompute=True, recompute_every=2), stats, env, 64)
    even = sum(env.fwd_s(b, 64, 1) for b in stats.blocks[::2])
    assert half.breakdown["compute"] == pytest.approx(one.breakdown["compute"] + even, rel=1e-6)


def test_a_calibrated_profile_replaces_the_catalog_inside_its_host() -> None:
    from polytrain.planner.types import Curve, HostProfile

    curve = Curve(((1e3, 1e-4), (1e6, 1e-2)))
    profile = HostProfile(
        fingerprint="test",
        device="cpu",
        matmul_flops={"fp32": 5e10},
        mem_bw=1e10,
        collectives={"all_reduce": {2: curve}},
    )
    env = Env(parse_cluster("2x2xcpu:eth10"), profile=profile)
    assert env.flops_rate == 5e10
    assert env.mem_bw == 1e10
    # measured curve inside the host (interpolated), rescaled for an unmeasured world size
    assert env.collective_s("all_reduce", 5e5, 2, 1) == pytest.approx(curve.seconds(5e5))
    # a group that leaves the host uses the catalog link, not the loopback measurement; cpu
    # workers share their host's one NIC, here with the other host-crossing pair
    eth = 2 * 1 / 2 * 5e5 / (1.25e9 / 2) + 2 * 14e-6 + 8.4e-6
    assert env.collective_s("all_reduce", 5e5, 2, 2) == pytest.approx(eth)


def test_host_nic_is_shared_by_the_flows_that_cross_it() -> None:
    """[Note: shared host link], as measured on the emulated 2 x 2 cluster: the flat 4-rank ring
    crosses each host's link once per direction and gets all of it; the two cross-host pairs
    (dp of a dp2 x tp2 mesh) share it; a rail-optimized GPU cluster shares nothing."""
    cpu = parse_cluster("2x2xcpu:eth10")
    assert cpu.nic == "host"
    full = cpu.inter.bandwidth if cpu.inter else 0.0
    assert cpu.bandwidth_for(1, 4) == full  # flat ring over both hosts
    assert cpu.bandwidth_for(2, 2) == full / 2  # two pairs, one member per host each
    assert cpu.bandwidth_for(1, 2) == cpu.intra.bandwidth  # stays in the host
    four = parse_cluster("2x4xcpu:eth10")
    assert four.bandwidth_for(2, 4) == full / 2  # 2 members per host: two groups share
    assert four.bandwidth_for(4, 2) == full / 4
    gpu = parse_cluster("2x8xH100:ib400")
    assert gpu.nic == "device" and gpu.inter is not None
    assert gpu.bandwidth_for(8, 2) == gpu.inter.bandwidth


def test_pipeline_accumulation_reruns_the_flushed_program() -> None:
    # PipelineStrategy runs the m-micro-batch program once per accumulation micro-step
    stats = gpt_stats(n_layer=4, n_embd=256, n_head=4, block_size=64, vocab_size=64)
    env = Env(parse_cluster("1x2xA100-40GB"))
    one = predict(Layout(pp=2, microbatches=4), stats, env, 16)
    two = predict(Layout(pp=2, microbatches=4, grad_accum=2), stats, env, 32)
    opt = one.breakdown["optimizer"]
    assert two.step_s - opt == pytest.approx(2 * (one.step_s - opt))
    assert two.breakdown["bubble"] == pytest.approx(2 * one.breakdown["bubble"])


def _cpu_profile(**extra: object) -> HostProfile:
    fields: dict[str, object] = {
        "fingerprint": "test",
        "device": "cpu",
        "matmul_flops": {"fp32": 10e9, "bf16": 5e9},
        "mem_bw": 1e10,
        "matmul_concurrent": {1: 10e9, 2: 6e9, 4: 2e9},
    }
    fields.update(extra)
    return HostProfile(**fields)  # type: ignore[arg-type]


def test_concurrent_rate_interpolates_and_shares_past_the_largest_count() -> None:
    measured = {1: 10.0, 2: 6.0, 4: 2.0}
    assert concurrent_rate(measured, 2) == 6.0
    assert concurrent_rate(measured, 3) == pytest.approx(4.0)  # halfway between 2 and 4
    assert concurrent_rate(measured, 8) == pytest.approx(1.0)  # 4 x 2 shared by 8
    assert concurrent_rate(measured, 0) == 10.0


def test_cpu_ranks_compute_at_the_shared_core_rate() -> None:
    """[Note: shared cores]: every rank of a host computing at once gets the concurrent rate;
    the dtype keeps its ratio to fp32; a GPU cluster ignores the profile's CPU sharing."""
    profile = _cpu_profile()
    four = Env(parse_cluster("1x4xcpu"), profile=profile)
    assert four.flops_rate == pytest.approx(2e9)
    assert four.cpu_slowdown == pytest.approx(5.0)
    assert Env(parse_cluster("1x4xcpu").with_size(2), profile=profile).flops_rate == 6e9
    assert Env(parse_cluster("1x4xcpu"), profile=profile, computing=1).flops_rate == 10e9
    assert Env(parse_cluster("1x4xcpu"), "bf16", profile).flops_rate == pytest.approx(1e9)
    assert Env(parse_cluster("1x4xA100-40GB"), profile=profile).flops_rate == 10e9
    # a measured block time slows by the same factor
    block = BlockStats("b", 1, 4, 1e6, 0.0, 0.0, fwd_s=1e-3, bwd_s=2e-3)
    assert four.fwd_s(block, 2) == pytest.approx(2e-3 * 5)


def test_a_measured_step_slowdown_decides_over_the_matmul_rates() -> None:
    """[Note: shared cores, measured on a step]: with `step_slowdown` the cost model slows CPU
    work by the factor measured on a transformer layer's step for that many processes
    (interpolated between counts, shared evenly past the largest), not by the matmul rates'
    ratio; a profile without it keeps the matmul rates."""
    profile = _cpu_profile(step_slowdown={2: 1.1, 4: 2.4})
    two = Env(parse_cluster("1x2xcpu"), profile=profile)
    assert two.cpu_slowdown == pytest.approx(1.1)
    assert two.flops_rate == pytest.approx(10e9 / 1.1)
    assert Env(parse_cluster("1x4xcpu"), profile=profile).cpu_slowdown == pytest.approx(2.4)
    assert Env(parse_cluster("1x8xcpu"), profile=profile).cpu_slowdown == pytest.approx(4.8)
    three = Env(parse_cluster("1x3xcpu"), profile=profile).cpu_slowdown
    assert 1.1 < three < 2.4
    assert Env(parse_cluster("1x2xcpu"), profile=_cpu_profile()).cpu_slowdown == pytest.approx(
        10 / 6
    )
    fast = _cpu_profile(step_slowdown={2: 0.9})  # faster beside another: noise, never < 1
    assert Env(parse_cluster("1x2xcpu"), profile=fast).cpu_slowdown == 1.0


def test_calibrated_end_of_step_costs_per_tensor_and_byte() -> None:
    """[Note: per-step costs]: check + clip + update, each a * tensors + b * bytes, summed and
    slowed by the shared cores; without them the memory-bound update alone."""
    costs = {
        "adamw": (50e-6, 2e-9),
        "sgd": (3e-6, 1e-10),
        "check": (3e-6, 3e-11),
        "clip": (5e-6, 1e-10),
    }
    env = Env(parse_cluster("1x1xcpu"), profile=_cpu_profile(step_costs=costs))
    params, tensors = 1e6, 10.0
    nbytes = params * 4
    expected = sum(costs[p][0] * tensors + costs[p][1] * nbytes for p in ("adamw", "check", "clip"))
    got = env.optimizer_s(params, 2, 4, tensors=tensors, optimizer="adamw", clip=True)
    assert got == pytest.approx(expected)
    no_clip = env.optimizer_s(params, 2, 4, tensors=tensors, optimizer="adamw")
    assert no_clip == pytest.approx(
        expected - costs["clip"][0] * tensors - costs["clip"][1] * nbytes
    )
    shared = Env(parse_cluster("1x4xcpu"), profile=_cpu_profile(step_costs=costs))
    assert shared.optimizer_s(params, 2, 4, tensors=tensors, clip=True) == pytest.approx(
        5 * expected
    )
    bare = Env(parse_cluster("1x1xcpu"), profile=_cpu_profile())
    assert bare.optimizer_s(params, 2, 4, tensors=tensors) == pytest.approx(params * 4 * 7 / 1e10)


def test_a_parameter_server_prices_the_fused_optimizer() -> None:
    """[Note: fused server optimizer]: a server's update is priced with the calibrated fused
    optimizer; a profile measured before fused figures existed prices the default one."""
    costs = {"adamw": (50e-6, 2e-9), "adamw_fused": (5e-6, 5e-10), "check": (3e-6, 3e-11)}
    env = Env(parse_cluster("1x3xcpu"), profile=_cpu_profile(step_costs=costs))
    params, tensors = 1e6, 60.0
    fused = env.optimizer_s(params, 2, 4, tensors=tensors, fused=True)
    assert fused == pytest.approx(
        sum(costs[p][0] * tensors + costs[p][1] * params * 4 for p in ("adamw_fused", "check"))
        * env.cpu_slowdown
    )
    older = {k: v for k, v in costs.items() if k != "adamw_fused"}
    old_env = Env(parse_cluster("1x3xcpu"), profile=_cpu_profile(step_costs=older))
    assert old_env.optimizer_s(params, 2, 4, tensors=tensors, fused=True) == pytest.approx(
        env.optimizer_s(params, 2, 4, tensors=tensors)
    )
    g = params * 4
    step, _ = ps_step(env, "sync", 2, 1, 0.5, g, params, 2, 4, tensors=tensors)
    old_step, _ = ps_step(old_env, "sync", 2, 1, 0.5, g, params, 2, 4, tensors=tensors)
    assert old_step - step == pytest.approx(env.optimizer_s(params, 2, 4, tensors=tensors) - fused)


def test_predict_adds_the_end_of_step_per_rank() -> None:
    """dp1: the step grows by exactly the calibrated end of step over the model's tensors;
    ZeRO-2 pays the per-byte part on its 1/dp shard only."""
    stats = gpt_stats(n_layer=2, n_embd=64, n_head=4, block_size=16, vocab_size=64)
    costs = {"adamw": (50e-6, 2e-9), "check": (3e-6, 3e-11), "clip": (5e-6, 1e-10)}
    cluster = parse_cluster("1x1xcpu")
    plain = predict(Layout(), stats, Env(cluster, profile=_cpu_profile()), 8)
    timed = predict(Layout(), stats, Env(cluster, profile=_cpu_profile(step_costs=costs)), 8)
    tensors = sum(b.tensors for b in stats.blocks)
    assert tensors == 2 + 2 * 16 + 3
    per = {p: a * tensors + b * stats.param_bytes for p, (a, b) in costs.items()}
    memory_bound = stats.param_bytes * 7 / 1e10
    assert timed.step_s - plain.step_s == pytest.approx(sum(per.values()) - memory_bound)


def test_non_matmul_time_needs_a_calibrated_operator_cost() -> None:
    """[Note: non-matmul time]: operator dispatch (not split by tp) plus the bytes the
    non-matmul operators move (split by tp), only with a calibrated `op_s`."""
    block = BlockStats(
        "b", 1, 4, 1e9, 0.0, 0.0, fwd_ops=40, bwd_ops=100, fwd_moved_bytes=1e6, bwd_moved_bytes=3e6
    )
    cluster = parse_cluster("1x1xcpu")
    bare = Env(cluster, profile=_cpu_profile())
    assert bare.fwd_s(block, 8) == pytest.approx(1e9 * 8 / 10e9)  # FLOPs alone
    env = Env(cluster, profile=_cpu_profile(op_s=5e-6))
    assert env.fwd_s(block, 8) == pytest.approx(0.8 + 40 * 5e-6 + 8e6 / 1e10)
    assert env.bwd_s(block, 8, tp=2) == pytest.approx(0.8 + 100 * 5e-6 + 12e6 / 1e10)
    assert Env(parse_cluster("1x1xA100-40GB")).fwd_s(block, 8) == pytest.approx(
        1e9 * 8 / Env(parse_cluster("1x1xA100-40GB")).flops_rate
    )


def test_zero_pays_the_calibrated_fsdp_hooks_per_unit() -> None:
    """[Note: FSDP2 unit overhead]: every sharded block and the root, per micro-step, slowed by
    shared cores; plain DDP pays none."""
    stats = gpt_stats(n_layer=2, n_embd=64, n_head=4, block_size=16, vocab_size=64)
    cluster = parse_cluster("1x2xcpu")
    base = Env(cluster, profile=_cpu_profile())
    hooked = Env(cluster, profile=_cpu_profile(fsdp_unit_s={2: 1e-3, 3: 2e-3}))
    units = len(stats.blocks) + 1
    for stage, per_unit in ((2, 1e-3), (3, 2e-3)):
        layout = Layout(dp=2, zero=stage)
        extra = predict(layout, stats, hooked, 8).step_s - predict(layout, stats, base, 8).step_s
        assert extra == pytest.approx(per_unit * units * hooked.cpu_slowdown)
    two = predict(Layout(dp=2, zero=3, grad_accum=2), stats, hooked, 8)
    assert two.breakdown["fsdp_hooks"] == pytest.approx(2 * 2e-3 * units * hooked.cpu_slowdown)
    assert (
        predict(Layout(dp=2), stats, hooked, 8).step_s
        == predict(Layout(dp=2), stats, base, 8).step_s
    )


def test_fsdp_units_with_many_tensors_pay_the_calibrated_per_tensor_overhead() -> None:
    """[Note: FSDP2 tensor overhead]: beyond its per-unit figure a unit pays the per-tensor
    figure for each parameter tensor past two (a one-Linear unit's, what the per-unit figure
    was measured with); none without the figure."""
    stats = gpt_stats(n_layer=2, n_embd=64, n_head=4, block_size=16, vocab_size=64)
    cluster = parse_cluster("1x2xcpu")
    per_unit = _cpu_profile(fsdp_unit_s={2: 1e-3})
    per_tensor = _cpu_profile(fsdp_unit_s={2: 1e-3}, fsdp_tensor_s={2: 5e-5})
    env, with_tensors = Env(cluster, profile=per_unit), Env(cluster, profile=per_tensor)
    assert with_tensors.fsdp_overhead_s(2, 3, tensors=6) == env.fsdp_overhead_s(2, 3, 6)
    assert with_tensors.fsdp_overhead_s(2, 3, tensors=16) == pytest.approx(
        (3 * 1e-3 + 10 * 5e-5) * env.cpu_slowdown
    )
    units, tensors = len(stats.blocks) + 1, sum(b.tensors for b in stats.blocks)
    assert tensors > 2 * units  # a transformer block holds more than one Linear's two
    layout = Layout(dp=2, zero=2)
    extra = predict(layout, stats, with_tensors, 8).breakdown["fsdp_hooks"]
    extra -= predict(layout, stats, env, 8).breakdown["fsdp_hooks"]
    assert extra == pytest.approx(5e-5 * (tensors - 2 * units) * env.cpu_slowdown)


def test_small_weights_run_their_matmuls_at_the_calibrated_small_size_rate() -> None:
    """[Note: matmul size]: a block of 128-wide Linears is priced at the 128 rate, one of
    1024-wide Linears at the largest size's, one in between by log-log interpolation; without
    rates by size (or Linear shapes) the single calibrated rate stays."""
    from polytrain.planner.cost.rates import size_rate
    from polytrain.planner.types import BlockStats

    by_size = {128: 4e9, 1024: 10e9}
    env = Env(
        parse_cluster("1x1xcpu"), profile=_cpu_profile(matmul_by_size={"fp32": by_size})
    )  # one process: the 10e9 single-process rate, no sharing

    def block(*linears: tuple[int, int]) -> BlockStats:
        return BlockStats("b", 0, 0, 1e9, 0.0, 0.0, linears=linears)

    assert env.matmul_rate(block((128, 512), (512, 128))) == pytest.approx(4e9)
    assert env.matmul_rate(block((1024, 4096))) == pytest.approx(10e9)
    assert env.matmul_rate(block((64, 64))) == pytest.approx(4e9)  # clamped to the range
    middle = env.matmul_rate(block((362, 362)))  # sqrt(128 * 1024) ~ 362: the geometric middle
    assert middle == pytest.approx((4e9 * 10e9) ** 0.5, rel=1e-3)
    assert size_rate(by_size, 362.04) == pytest.approx(middle, rel=1e-3)
    assert env.fwd_s(block((128, 128)), 1.0) > env.fwd_s(block((1024, 1024)), 1.0)
    plain = Env(parse_cluster("1x1xcpu"), profile=_cpu_profile())
    assert plain.matmul_rate(block((128, 128))) == plain.flops_rate
    assert env.matmul_rate(block()) == env.flops_rate


def test_a_tensor_parallel_rank_runs_its_matmuls_at_its_shards_size() -> None:
    """[Note: matmul size at a shard]: a column-parallel 128 x 128 Linear is 128 x 64 on each of
    two ranks, a row-parallel 256 x 128 one 128 x 128; a Linear the plan leaves whole keeps its
    shape; without the plan's modules every Linear is split by its outputs."""
    from polytrain.planner.types import BlockStats, TPModule

    col = TPModule("colwise", 128, 2, 512.0, 512.0, linear=(128, 128))
    row = TPModule("rowwise", 256, 1, 1024.0, 512.0, linear=(256, 128))
    linears = ((128, 128), (256, 128), (128, 64))  # the last: not in the plan
    planned = BlockStats("b", 0, 0, 1e9, 0.0, 0.0, linears=linears, tp_modules=(col, row))
    assert planned.linears_at(1) == linears
    assert planned.linears_at(2) == ((128, 64), (128, 128), (128, 64))
    unplanned = BlockStats("b", 0, 0, 1e9, 0.0, 0.0, linears=linears)
    assert unplanned.linears_at(2) == ((128, 64), (256, 64), (128, 32))
    by_size = {64: 2e9, 128: 4e9, 1024: 10e9}
    env = Env(parse_cluster("1x1xcpu"), profile=_cpu_profile(matmul_by_size={"fp32": by_size}))
    only_col = BlockStats("b", 0, 0, 1e9, 0.0, 0.0, linears=((128, 128),), tp_modules=(col,))
    assert env.matmul_rate(only_col, tp=1) == pytest.approx(4e9)
    assert env.matmul_rate(only_col, tp=2) == pytest.approx(2e9)  # 128 x 64: the 64 rate
    assert env.fwd_s(only_col, 1.0, tp=2) > env.fwd_s(only_col, 1.0, tp=1) / 2


def test_the_end_of_steps_reduces_cost_the_in_step_probe_where_ranks_reach_them_together() -> None:
    """[Note: the step's reductions in a step]: on the calibrated CPU host a data- or
    tensor-parallel step pays the in-step figure for its world size per small all-reduce (the
    loss and flag; the norm too when the gradients are sharded), past the largest measured size
    that figure times the isolated curves' ratio; a pipeline's stages (they reach it apart), a
    group across hosts and a profile without the figure keep the isolated curve."""
    curve = Curve(((8.0, 2e-3), (2**20, 6e-3)))
    collectives = {"all_reduce": {2: curve, 4: Curve(((8.0, 5e-3), (2**20, 9e-3)))}}
    measured = {2: 4e-4, 4: 1.5e-3}
    prof = _cpu_profile(collectives=collectives, reduce_in_step=measured)
    four = Env(parse_cluster("1x4xcpu"), profile=prof)
    iso = Env(parse_cluster("1x4xcpu"), profile=_cpu_profile(collectives=collectives))
    assert four.step_reduce_s(2) == pytest.approx(4e-4)
    assert four.step_reduce_s(4) == pytest.approx(1.5e-3)
    assert four.step_reduce_s(1) == 0.0
    assert four.step_reduce_s(2, together=False) == pytest.approx(2e-3)
    assert iso.step_reduce_s(4) == pytest.approx(5e-3)
    eight = Env(parse_cluster("1x8xcpu"), profile=prof)
    ratio = eight.collective_s("all_reduce", 8.0, 8) / eight.collective_s("all_reduce", 8.0, 4)
    assert eight.step_reduce_s(8) == pytest.approx(1.5e-3 * ratio)
    across = Env(parse_cluster("2x2xcpu:eth10"), profile=prof)
    assert across.step_reduce_s(4) == across.collective_s("all_reduce", 8.0, 4)
    # in a prediction: the end of step's share of the optimizer term
    stats = gpt_stats(n_layer=2, n_embd=64, n_head=4, block_size=16, vocab_size=64)
    assert stats.grad_clip

    def end(layout: Layout, env: Env) -> float:
        return predict(layout, stats, env, 8).breakdown["optimizer"]

    dp2, tp2, pp2 = Layout(dp=2), Layout(tp=2), Layout(pp=2, microbatches=2)
    assert end(dp2, iso) - end(dp2, four) == pytest.approx(2e-3 - 4e-4)  # loss and flag
    assert end(tp2, iso) - end(tp2, four) == pytest.approx(2 * (2e-3 - 4e-4))  # and the norm
    assert end(pp2, iso) == pytest.approx(end(pp2, four))


def test_a_clip_over_dtensor_gradients_pays_its_calibrated_call() -> None:
    """[Note: DTensor clip per call]: on the calibrated CPU host the clip over DTensor
    gradients costs its measured per-call figure for the mesh they live on (tp alone: the tp
    group; ZeRO and dp x tp: dp x tp ranks) in place of the norm's small all-reduce; plain
    gradients (DDP), a clip-free job, a profile without the figure and an accelerator keep
    that all-reduce."""
    curve = Curve(((8.0, 2e-3), (2**20, 6e-3)))
    collectives = {"all_reduce": {2: curve, 4: Curve(((8.0, 5e-3), (2**20, 9e-3)))}}
    reduce = {2: 4e-4, 4: 1.5e-3}
    calls = {2: 1.9e-3, 4: 2.8e-3}
    with_call = _cpu_profile(
        collectives=collectives, reduce_in_step=reduce, dtensor_clip_call_s=calls
    )
    without = _cpu_profile(collectives=collectives, reduce_in_step=reduce)
    four = Env(parse_cluster("1x4xcpu"), profile=with_call)
    assert four.dtensor_clip_call_s(2) == pytest.approx(1.9e-3)
    assert four.dtensor_clip_call_s(3) == pytest.approx(2.35e-3)
    assert four.dtensor_clip_call_s(1) == 0.0
    assert Env(parse_cluster("1x4xcpu"), profile=without).dtensor_clip_call_s(2) == 0.0
    assert Env(parse_cluster("1x4xA100-40GB"), profile=with_call).dtensor_clip_call_s(2) == 0.0
    assert Env(parse_cluster("2x2xcpu:eth10"), profile=with_call).dtensor_clip_call_s(4) == 0.0

    stats = gpt_stats(n_layer=2, n_embd=64, n_head=4, block_size=16, vocab_size=64)
    assert stats.grad_clip
    plain = Env(parse_cluster("1x4xcpu"), profile=without)

    def extra(layout: Layout, s: ModelStats = stats) -> float:
        return (
            predict(layout, s, four, 8).breakdown["optimizer"]
            - predict(layout, s, plain, 8).breakdown["optimizer"]
        )

    assert extra(Layout(tp=2)) == 0.0  # no plan's modules known: no DTensor gradients
    col = TPModule("colwise", 64, 2, 256.0, 256.0, linear=(64, 64))
    planned = replace(stats, blocks=tuple(replace(b, tp_modules=(col,)) for b in stats.blocks))
    assert extra(Layout(tp=2), planned) == pytest.approx(1.9e-3 - 4e-4)  # the tp group's mesh
    assert extra(Layout(dp=2, zero=2)) == pytest.approx(1.9e-3 - 4e-4)  # FSDP2's dp mesh
    assert extra(Layout(dp=2, tp=2)) == pytest.approx(2.8e-3 - 1.5e-3)  # replicate: dp x tp
    assert extra(Layout(dp=2)) == 0.0  # DDP: plain gradients
    assert extra(Layout(tp=2), replace(stats, grad_clip=False)) == 0.0  # no clip, no norm


def test_ranks_that_wait_for_each_other_pay_the_calibrated_skew() -> None:
    """[Note: ranks' skew]: on the calibrated CPU host a layout whose ranks all wait for each
    other every step (data or tensor parallel, ZeRO, a synchronous parameter server) pays the
    measured share of its compute for that many ranks (in proportion between measured counts,
    the nearest past them); a pipeline (its waits are simulated), an asynchronous server, one
    rank, a group across hosts, an accelerator and a profile without the figure pay none."""
    skew = {2: 0.04, 4: 0.08}
    prof = _cpu_profile(step_skew=skew)
    four = Env(parse_cluster("1x4xcpu"), profile=prof)
    assert four.skew_s(1.0, 2) == pytest.approx(0.04)
    assert four.skew_s(1.0, 3) == pytest.approx(0.06)
    assert four.skew_s(1.0, 4) == pytest.approx(0.08)
    assert Env(parse_cluster("1x8xcpu"), profile=prof).skew_s(1.0, 8) == pytest.approx(0.08)
    assert four.skew_s(1.0, 1) == 0.0
    assert Env(parse_cluster("1x4xcpu"), profile=_cpu_profile()).skew_s(1.0, 4) == 0.0
    assert Env(parse_cluster("2x2xcpu:eth10"), profile=prof).skew_s(1.0, 4) == 0.0
    assert Env(parse_cluster("1x4xA100-40GB"), profile=prof).skew_s(1.0, 4) == 0.0

    stats = gpt_stats(n_layer=2, n_embd=64, n_head=4, block_size=16, vocab_size=64)
    plain = Env(parse_cluster("1x4xcpu"), profile=_cpu_profile())

    def extra(layout: Layout) -> float:
        with_skew, without = predict(layout, stats, four, 8), predict(layout, stats, plain, 8)
        assert with_skew.breakdown.get("skew", 0.0) == pytest.approx(
            with_skew.step_s - without.step_s
        )
        return with_skew.step_s - without.step_s

    def own_work(b: dict[str, float]) -> float:  # a rank's own, between the synchronizations
        return b["compute"] + b["optimizer"] + b["fsdp_hooks"] + b["loop"]

    dp2 = predict(Layout(dp=2), stats, four, 8).breakdown
    assert extra(Layout(dp=2)) == pytest.approx(0.04 * own_work(dp2))
    dp2_tp2 = predict(Layout(dp=2, tp=2), stats, four, 8).breakdown
    assert extra(Layout(dp=2, tp=2)) == pytest.approx(0.08 * own_work(dp2_tp2))
    assert extra(Layout(dp=2, zero=3)) > 0
    assert extra(Layout(dp=2, sync="ps", ps_servers=1, ps_mode="sync")) > 0
    assert extra(Layout(dp=2, sync="ps", ps_servers=1, ps_mode="async")) == 0.0
    assert extra(Layout(pp=2, microbatches=2)) == 0.0
    assert extra(Layout()) == 0.0


def test_each_synchronization_priced_apart_pays_the_calibrated_wait() -> None:
    """[Note: ranks' skew], [Note: synchronizations priced apart]: beside the share of its
    compute, a step pays the calibrated seconds per synchronization for each collective whose
    price was timed without compute before it: DDP's one bucket, FSDP2's replicate's one
    all-reduce per block, each tensor-parallel collective of every micro-step (recomputation's
    forward again), the DTensor clip's norm; not the end of step's reduce or FSDP2's
    in-step-timed gathers."""
    prof = _cpu_profile(sync_wait_s={2: 1e-3, 4: 2e-3})
    four = Env(parse_cluster("1x4xcpu"), profile=prof)
    assert four.skew_s(0.0, 2, syncs=3) == pytest.approx(3e-3)
    assert four.skew_s(0.0, 3, syncs=1) == pytest.approx(1.5e-3)
    assert four.skew_s(0.0, 1, syncs=3) == 0.0
    assert Env(parse_cluster("2x2xcpu:eth10"), profile=prof).skew_s(0.0, 4, syncs=3) == 0.0
    assert Env(parse_cluster("1x4xA100-40GB"), profile=prof).skew_s(0.0, 4, syncs=3) == 0.0

    stats = gpt_stats(n_layer=2, n_embd=64, n_head=4, block_size=16, vocab_size=64)
    col = TPModule("colwise", 64, 2, 256.0, 256.0, linear=(64, 64))  # a backward all-reduce
    row = TPModule("rowwise", 64, 2, 256.0, 256.0, linear=(64, 64))  # a forward all-reduce
    planned = replace(stats, blocks=tuple(replace(b, tp_modules=(col, row)) for b in stats.blocks))
    call = {2: 1e-3}  # the clip's per call figure, with and without the waits
    clipped = Env(parse_cluster("1x4xcpu"), profile=_cpu_profile(dtensor_clip_call_s=call))
    plain = Env(parse_cluster("1x4xcpu"), profile=_cpu_profile())

    def syncs(layout: Layout, model: ModelStats = stats, clip: bool = False) -> float:
        base = clipped if clip else plain
        env = replace(base, profile=replace(base.profile, sync_wait_s={2: 1e-3, 4: 2e-3}))
        waits = predict(layout, model, env, 8).step_s - predict(layout, model, base, 8).step_s
        return waits / (1e-3 if layout.devices == 2 else 2e-3)

    blocks = len(stats.blocks)
    assert syncs(Layout(dp=2)) == pytest.approx(1)  # one bucket
    assert syncs(Layout(tp=2), planned) == pytest.approx(2 * blocks)
    assert syncs(Layout(tp=2), planned, clip=True) == pytest.approx(2 * blocks + 1)
    assert syncs(Layout(tp=2, recompute=True), planned) == pytest.approx(3 * blocks)
    assert syncs(Layout(tp=2, grad_accum=2), planned) == pytest.approx(4 * blocks)
    assert syncs(Layout(dp=2, tp=2), planned) == pytest.approx(blocks + 2 * blocks)
    assert syncs(Layout(dp=2, zero=3)) == pytest.approx(0)
    assert syncs(Layout(dp=2, zero=3), clip=True) == pytest.approx(1)
    assert syncs(Layout(pp=2, microbatches=2)) == 0.0
    assert syncs(Layout(dp=2, sync="ps", ps_servers=1, ps_mode="sync")) == 0.0


def test_leaf_servers_divide_the_roots_traffic_by_the_group_size() -> None:
    """15 workers in groups of 4 (one leaf per host): the root level is a flat exchange with 4
    pushers over the inter-host link, after each group's exchange with its leaf inside its host."""
    env = Env(parse_cluster("4x4xcpu:eth10"))
    g = 1e8
    _step, comm = ps_step(env, "sync", 15, 1, 0.5, g, g / 4, 2, 4, per_leaf=4)
    _flat_step, flat_comm = ps_step(env, "sync", 15, 1, 0.5, g, g / 4, 2, 4)
    group = env.link(1, 4)
    in_group = 4 * g / group.bandwidth + 2 * group.latency + group.base
    # the root's level: 4 leaves push and pull, as 4 workers of a flat job on the same link
    inter = env.link(1, 16)
    root = 4 * g / inter.bandwidth + 2 * inter.latency + inter.base
    assert comm == pytest.approx(in_group + root, rel=1e-6)
    assert flat_comm == pytest.approx(15 * g / inter.bandwidth + 2 * inter.latency + inter.base)
    assert comm < flat_comm
    # async: groups are sync inside; the root absorbs 4 pushes per global step, not 15
    a_step, _ = ps_step(env, "async", 15, 1, 0.01, g, g / 4, 2, 4, per_leaf=4)
    a_flat, _ = ps_step(env, "async", 15, 1, 0.01, g, g / 4, 2, 4)
    assert a_step < a_flat

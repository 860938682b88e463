"""DTensor's costs in the cost model (pure, milliseconds): the end of step on DTensor parameters,
tensor parallelism's collectives per plan module and its per-module dispatch, and FSDP2's
synchronous collectives on a CPU host."""

from __future__ import annotations

from dataclasses import replace

import pytest

from polytrain.planner.cluster import parse_cluster
from polytrain.planner.cost import Env, predict
from polytrain.planner.cost.dp import replicate_backward
from polytrain.planner.cost.tp import tp_comm_s
from polytrain.planner.cost.zero import zero_step
from polytrain.planner.stats_pure import gpt_stats
from polytrain.planner.types import BlockStats, Layout, ModelStats, TPModule
from tests.helpers.planner import cpu_profile

PLAIN = {"adamw": (20e-6, 1e-9), "check": (2e-6, 2e-11), "clip": (4e-6, 5e-11)}
DIST = {"dtensor adamw": (130e-6, 6e-10), "dtensor check": (3e-6, 2e-11)}  # no dtensor clip


def _layer(width: int = 64, samples_bytes: float = 4096.0) -> tuple[TPModule, ...]:
    """gpt's plan for one layer: q, k, v, fc column-parallel, both projections row-parallel."""
    col = TPModule("colwise", width, 2, samples_bytes, samples_bytes)
    row = TPModule("rowwise", width, 2, samples_bytes, samples_bytes)
    return (col, col, col, row, col, row)


def _planned(stats: ModelStats, vocab: int) -> ModelStats:
    """gpt_stats with the runtime plan's modules: vocab embedding, layers, gathered head."""
    first, *layers, last = stats.blocks
    embed = (TPModule("vocab", vocab, 1, 0.0, 4096.0),)
    head = (TPModule("colwise_gather", vocab, 1, 4096.0, 4096.0 * vocab / 64),)
    blocks = (
        replace(first, tp_modules=embed),
        *(replace(b, tp_modules=_layer()) for b in layers),
        replace(last, tp_modules=head),
    )
    return replace(stats, blocks=blocks)


STATS = _planned(gpt_stats(n_layer=2, n_embd=64, n_head=4, block_size=16, vocab_size=63), 63)


def test_dtensor_parameters_pay_the_dtensor_end_of_step() -> None:
    """[Note: DTensor end of step]: ZeRO-2 holds every tensor as a DTensor, so its end of step
    is priced at the "dtensor" figures over all of them (the clip, not measured on DTensors,
    at the plain one); DDP's stays plain."""
    cluster = parse_cluster("1x2xcpu")
    plain = Env(cluster, profile=cpu_profile(step_costs=PLAIN))
    both = Env(cluster, profile=cpu_profile(step_costs={**PLAIN, **DIST}))
    tensors = sum(b.tensors for b in STATS.blocks)
    shard_bytes = STATS.param_bytes / 2
    zero = Layout(dp=2, zero=2)
    extra = (
        predict(zero, STATS, both, 8).breakdown["optimizer"]
        - predict(zero, STATS, plain, 8).breakdown["optimizer"]
    )
    expected = sum(
        (DIST[f"dtensor {p}"][0] - PLAIN[p][0]) * tensors
        + (DIST[f"dtensor {p}"][1] - PLAIN[p][1]) * shard_bytes
        for p in ("adamw", "check")
    )
    assert extra == pytest.approx(expected * both.cpu_slowdown)
    ddp = Layout(dp=2)
    assert predict(ddp, STATS, both, 8).step_s == pytest.approx(
        predict(ddp, STATS, plain, 8).step_s
    )


def test_tensor_parallel_alone_counts_the_plan_modules_parameters_as_dtensors() -> None:
    """tp2: the parallelized modules' parameters are DTensors, the rest (layer norms, the
    embedding and head whose vocabulary 63 tp2 does not divide) stay plain; dp2 x tp2
    (FSDP2's replicate) makes all of them DTensors."""
    env = Env(parse_cluster("1x4xcpu"), profile=cpu_profile(step_costs={**PLAIN, **DIST}))
    plain_env = Env(parse_cluster("1x4xcpu"), profile=cpu_profile(step_costs=PLAIN))
    per_tensor = (DIST["dtensor adamw"][0] - PLAIN["adamw"][0]) + (
        DIST["dtensor check"][0] - PLAIN["check"][0]
    )
    dtensors = 2 * 12  # two layers of six 2-tensor modules
    tp2 = Layout(tp=2)
    got = (
        predict(tp2, STATS, env, 8).breakdown["optimizer"]
        - predict(tp2, STATS, plain_env, 8).breakdown["optimizer"]
    )
    applied = {m.style for b in STATS.blocks for m in b.tp_applied(2)}
    assert applied == {"colwise", "rowwise"}  # not the vocabulary rows (63 columns)
    shard = sum(b.params_per_tp_rank(2) for b in STATS.blocks) * 4
    tensors = sum(b.tensors for b in STATS.blocks)
    per_byte = sum(DIST[f"dtensor {p}"][1] - PLAIN[p][1] for p in ("adamw", "check"))
    expected = per_tensor * dtensors + per_byte * shard * dtensors / tensors
    assert got == pytest.approx(expected * env.cpu_slowdown)
    hybrid = Layout(dp=2, tp=2)
    all_of_them = (
        predict(hybrid, STATS, env, 8).breakdown["optimizer"]
        - predict(hybrid, STATS, plain_env, 8).breakdown["optimizer"]
    )
    assert all_of_them == pytest.approx(
        (per_tensor * tensors + per_byte * shard) * env.cpu_slowdown
    )


def test_tensor_parallel_collectives_follow_each_plan_module() -> None:
    """[Note: tensor-parallel modules]: forward all-reduces the two row-parallel outputs,
    backward the input gradient of each of the four column-parallel modules; the vocabulary
    rows do not apply when tp does not divide it."""
    env = Env(parse_cluster("1x2xcpu"))
    one = env.collective_s("all_reduce", 4096.0 * 8, 2, 1)
    layer = STATS.blocks[1]
    assert tp_comm_s(env, layer, 8, 2, first=False, last=False) == pytest.approx(2 * one)
    back = tp_comm_s(env, layer, 8, 2, first=False, last=False, backward=True)
    assert back == pytest.approx(4 * one)
    assert tp_comm_s(env, STATS.blocks[0], 8, 2, first=True, last=False) == 0.0
    assert tp_comm_s(env, STATS.blocks[-1], 8, 2, first=False, last=True, backward=True) == 0.0
    # a vocabulary tp divides: the embedding all-reduces its output in forward only (ids take
    # no gradient), the head gathers its logits in forward, reduces its input's gradient back
    even = replace(STATS.blocks[0], tp_modules=(TPModule("vocab", 64, 1, 0.0, 4096.0),))
    assert tp_comm_s(env, even, 8, 2, first=True, last=False) == pytest.approx(one)
    assert tp_comm_s(env, even, 8, 2, first=True, last=False, backward=True) == 0.0
    head = replace(STATS.blocks[-1], tp_modules=(TPModule("colwise_gather", 64, 1, 4096.0, 8e3),))
    assert tp_comm_s(env, head, 8, 2, first=False, last=True) == pytest.approx(
        env.collective_s("all_gather", 8e3 * 8, 2, 1)
    )
    assert tp_comm_s(env, head, 8, 2, first=False, last=True, backward=True) == pytest.approx(one)
    # without the modules: the old count (two all-reduces of the output per pass)
    old = replace(layer, tp_modules=None)
    assert tp_comm_s(env, old, 8, 2, first=False, last=False, backward=True) == pytest.approx(
        2 * env.collective_s("all_reduce", layer.output_bytes * 8, 2, 1)
    )


def test_tensor_parallel_pays_the_dtensor_dispatch_per_module() -> None:
    """[Note: DTensor module overhead]: calibrated seconds x parallelized modules per
    micro-step (12 in two layers; the embedding and head are not parallelized at tp2)."""
    cluster = parse_cluster("1x2xcpu")
    base = Env(cluster, profile=cpu_profile())
    paid = Env(cluster, profile=cpu_profile(tp_module_s=5e-4))
    for layout, micro in ((Layout(tp=2), 1), (Layout(tp=2, grad_accum=2), 2)):
        extra = predict(layout, STATS, paid, 8).step_s - predict(layout, STATS, base, 8).step_s
        assert extra == pytest.approx(5e-4 * 12 * micro * paid.cpu_slowdown)
    dp = Layout(dp=2)
    assert predict(dp, STATS, paid, 8).step_s == predict(dp, STATS, base, 8).step_s


def test_fsdp2_collectives_on_a_cpu_host_overlap_nothing() -> None:
    """[Note: FSDP2 on a CPU host]: every gather and reduce-scatter is in series with the
    compute (ZeRO-3 gathers again in backward); on a GPU the prefetch hides most of them."""
    fwd, bwd, pb = [1e-2] * 4, [2e-2] * 4, [1e6] * 4
    cpu = Env(parse_cluster("1x2xcpu"))
    gather = cpu.collective_s("all_gather", 1e6, 2, 1)
    scatter = cpu.collective_s("reduce_scatter", 1e6, 2, 1)
    f2, b2, e2 = zero_step(cpu, 2, fwd, bwd, pb, dp=2, stride=1)
    assert (f2, b2) == (pytest.approx(4e-2 + 4 * gather), pytest.approx(8e-2 + 4 * scatter))
    assert e2 == pytest.approx(4 * gather + 4 * scatter)
    _, b3, e3 = zero_step(cpu, 3, fwd, bwd, pb, dp=2, stride=1)
    assert b3 == pytest.approx(8e-2 + 4 * scatter + 4 * gather)
    assert e3 == pytest.approx(8 * gather + 4 * scatter)
    gpu = Env(parse_cluster("1x2xA100-40GB"))  # the first gather and the last scatter only
    one = gpu.collective_s("all_gather", 1e6, 2, 1)
    assert zero_step(gpu, 2, fwd, bwd, pb, dp=2, stride=1)[2] == pytest.approx(2 * one)


def test_fsdp2_collectives_in_a_step_cost_what_the_two_rank_probe_measured() -> None:
    """[Note: FSDP2 collectives in a step]: with the probe's curve, a unit's gathers and
    reduce-scatter cost its reading at the unit's bytes in all (shared as the isolated curves
    share it), for a data-parallel group of two on the calibrated host; other group sizes, a
    group across hosts and profiles without the curve keep the isolated curves."""
    from polytrain.planner.types import Curve

    fwd, bwd, pb = [1e-2] * 4, [2e-2] * 4, [1e6] * 4
    curve = {2: Curve(((1e3, 1e-3), (1e6, 4e-3))), 3: Curve(((1e3, 2e-3), (1e6, 9e-3)))}
    plain = Env(parse_cluster("1x4xcpu"), profile=cpu_profile())
    probed = Env(parse_cluster("1x4xcpu"), profile=cpu_profile(fsdp_in_step=curve))
    for stage, per_unit in ((2, 4e-3), (3, 9e-3)):
        f, b, exposed = zero_step(probed, stage, fwd, bwd, pb, dp=2, stride=1)
        assert exposed == pytest.approx(4 * per_unit)
        assert f + b == pytest.approx(sum(fwd) + sum(bwd) + 4 * per_unit)
        # accumulation micro-steps: the gathers' share of the in-step price only
        _, _, quiet = zero_step(probed, stage, fwd, bwd, pb, dp=2, stride=1, scatter=False)
        assert 0 < quiet < exposed
        for env, dp in ((plain, 2), (probed, 4)):
            iso = zero_step(env, stage, fwd, bwd, pb, dp=dp, stride=1)[2]
            assert iso == pytest.approx(
                zero_step(Env(env.cluster), stage, fwd, bwd, pb, dp=dp, stride=1)[2]
            )
    across = Env(parse_cluster("2x1xcpu:eth10"), profile=cpu_profile(fsdp_in_step=curve))
    assert across.fsdp_in_step_s(2, 1e6, 2, 1) is None


def test_replicate_on_a_cpu_host_all_reduces_each_block_in_series() -> None:
    cpu = Env(parse_cluster("1x4xcpu"))
    bwd, grads = [1e-2, 2e-2, 3e-2], [1e5, 2e5, 3e5]
    end, exposed = replicate_backward(cpu, bwd, grads, dp=2, stride=2)
    reduce = sum(cpu.collective_s("all_reduce", b, 2, 2) for b in grads)
    assert (end, exposed) == (pytest.approx(6e-2 + reduce), pytest.approx(reduce))
    block = BlockStats("b", 1, 4, 1.0, 0.0, 0.0)
    assert block.tp_applied(2) == ()  # unknown modules: nothing applied


def test_tp_collectives_in_a_step_cost_the_probe_of_as_many_ranks_on_the_host() -> None:
    """[Note: tensor-parallel collectives in a step]: a tp group of two on the calibrated CPU
    host pays the in-step all-reduce probed with the nearest count of ranks on the host (tp2
    alone: 2; dp2 x tp2: 4), an all-gather that price times the isolated curves' ratio; a
    degree of four, a group across hosts and a profile without the curve keep the isolated
    curves."""
    from polytrain.planner.types import Curve

    curves = {2: Curve(((1e4, 1e-3), (1e6, 2e-3))), 4: Curve(((1e4, 3e-3), (1e6, 5e-3)))}
    iso = Env(parse_cluster("1x2xcpu"), profile=cpu_profile())
    two = Env(parse_cluster("1x2xcpu"), profile=cpu_profile(tp_in_step=curves))
    four = Env(parse_cluster("1x4xcpu"), profile=cpu_profile(tp_in_step=curves))
    assert two.tp_collective_s("all_reduce", 1e6, 2) == pytest.approx(2e-3)
    assert four.tp_collective_s("all_reduce", 1e6, 2) == pytest.approx(5e-3)
    assert replace(four, computing=2).tp_collective_s("all_reduce", 1e4, 2) == pytest.approx(1e-3)
    ratio = iso.collective_s("all_gather", 1e6, 2) / iso.collective_s("all_reduce", 1e6, 2)
    assert two.tp_collective_s("all_gather", 1e6, 2) == pytest.approx(2e-3 * ratio)
    assert four.tp_collective_s("all_reduce", 1e6, 4) == four.collective_s("all_reduce", 1e6, 4)
    assert iso.tp_collective_s("all_reduce", 1e6, 2) == iso.collective_s("all_reduce", 1e6, 2)
    across = Env(parse_cluster("2x1xcpu:eth10"), profile=cpu_profile(tp_in_step=curves))
    assert across.tp_collective_s("all_reduce", 1e6, 2) == across.collective_s("all_reduce", 1e6, 2)
    # in a block: each of the plan's collectives at the in-step price
    layer = replace(STATS.blocks[1], tp_modules=_layer(samples_bytes=1e6))
    fwd = tp_comm_s(two, layer, 1.0, 2, first=False, last=False)
    bwd = tp_comm_s(two, layer, 1.0, 2, first=False, last=False, backward=True)
    assert (fwd, bwd) == (pytest.approx(2 * 2e-3), pytest.approx(4 * 2e-3))

"""[Note: loop overhead] and [Note: timing rounds] in measure/timing.py: the training step's
own Python priced per step and per micro-batch, and calibration's interleaved timing rounds."""

from __future__ import annotations

import pytest
import torch

from polytrain.measure.timing import Rounds, median_and_spread, timed_rounds
from polytrain.planner.cluster import parse_cluster
from polytrain.planner.cost import Env, predict
from polytrain.planner.stats_pure import gpt_stats
from polytrain.planner.types import Curve, Layout
from tests.helpers.planner import cpu_profile

STATS = gpt_stats(n_layer=4, n_embd=64, n_head=4, block_size=16, vocab_size=64)
PER_STEP, PER_MICRO = 3e-4, 2e-4


def _extra(layout: Layout, cluster: str = "1x4xcpu", **profile: object) -> tuple[float, float, Env]:
    """(step with the loop terms - step without, the breakdown's loop, the priced Env)."""
    clu = parse_cluster(cluster).with_size(layout.devices)
    bare = Env(clu, profile=cpu_profile(**profile))
    terms = {"loop_step_s": PER_STEP, "loop_microbatch_s": PER_MICRO, **profile}
    loop = Env(clu, profile=cpu_profile(**terms))
    with_loop = predict(layout, STATS, loop, 16)
    return (
        with_loop.step_s - predict(layout, STATS, bare, 16).step_s,
        with_loop.breakdown["loop"],
        loop,
    )


def test_spmd_pays_the_loop_once_per_step_and_per_micro_batch() -> None:
    for layout in (Layout(), Layout(dp=2), Layout(tp=2), Layout(dp=2, zero=3)):
        extra, loop, env = _extra(layout)
        assert extra == pytest.approx((PER_STEP + PER_MICRO) * env.cpu_slowdown)
        assert loop == pytest.approx(extra)
    extra, _, env = _extra(Layout(dp=2, grad_accum=4))
    assert extra == pytest.approx((PER_STEP + 4 * PER_MICRO) * env.cpu_slowdown)
    assert env.cpu_slowdown == pytest.approx(10 / 6)  # two ranks computing on the host


def test_pipeline_pays_the_micro_batch_share_inside_every_f_and_b() -> None:
    """Equal stages, no messages (one host, calibrated curves absent: the catalog's loopback is
    tiny but not zero, so compare against the simulation's own fill): every F and B of every
    stage grows by half a micro-batch's share, so the makespan grows by (m + p - 1) of it. (The
    two ranks share no cores here: [Note: a pipeline's shared cores] would price the stages at
    another count than the step's end.)"""
    p, m = 2, 4
    layout = Layout(pp=p, schedule="gpipe", microbatches=m)
    extra, loop, env = _extra(layout, matmul_concurrent={1: 10e9, 2: 10e9})
    share = PER_MICRO * env.cpu_slowdown
    assert extra == pytest.approx(PER_STEP * env.cpu_slowdown + (m + p - 1) * share, rel=0.02)
    assert loop == pytest.approx((PER_STEP + m * PER_MICRO) * env.cpu_slowdown)


def test_parameter_server_and_decentralized_workers_pay_one_step_and_one_micro_batch() -> None:
    """A worker's loop, slowed by the two workers computing at once (a PS layout's server
    waits on the network: [Note: shared cores])."""
    for layout in (
        Layout(dp=2, sync="ps", ps_servers=1, ps_mode="sync"),
        Layout(dp=2, sync="gossip", topology="ring"),
        Layout(dp=2, sync="localsgd", period=4),
    ):
        extra, loop, _ = _extra(layout)
        assert extra == pytest.approx((PER_STEP + PER_MICRO) * 10 / 6)
        assert loop == pytest.approx(extra)


def test_a_profile_without_the_loop_terms_prices_none() -> None:
    env = Env(parse_cluster("1x1xcpu"), profile=cpu_profile())
    assert predict(Layout(), STATS, env, 16).breakdown["loop"] == 0.0
    gpu = Env(parse_cluster("1x1xA100-40GB"))
    assert predict(Layout(), STATS, gpu, 16).breakdown["loop"] == 0.0


def test_median_and_spread_is_the_interquartile_range_over_the_median() -> None:
    assert median_and_spread([1.0, 2.0, 3.0, 4.0, 5.0]) == (3.0, pytest.approx(2.0 / 3.0))
    assert median_and_spread([2.0]) == (2.0, 0.0)
    assert median_and_spread([5.0, 5.0, 5.0]) == (5.0, 0.0)


def test_timing_rounds_interleave_every_function_in_every_round() -> None:
    """Each round times each function in turn (a block of 2 to 50 calls), so a burst of load
    falls on all of them alike; the warm-up calls each once first."""
    calls: list[str] = []
    fns = {k: (lambda k=k: calls.append(k)) for k in ("a", "b", "c")}
    out = timed_rounds(fns, torch.device("cpu"), budget_s=0.0, rounds=3)
    assert set(out) == {"a", "b", "c"}
    assert all(secs >= 0 and spread >= 0 for secs, spread in out.values())
    # budget 0: the minimum of two calls per function per round
    assert "".join(calls) == "abc" + "aabbcc" * 3


def test_rounds_can_be_spread_over_other_work() -> None:
    """`calibrate` runs the matmul rounds between its other measurements: each `round` is one
    more round (after one warm-up call each), `result` runs the rest, and no more than asked."""
    calls: list[str] = []
    rounds = Rounds({k: (lambda k=k: calls.append(k)) for k in "ab"}, torch.device("cpu"), 0.0, 4)
    rounds.round()
    calls.append("|")
    rounds.round()
    calls.append("|")
    out = rounds.result()
    rounds.round()  # all done: nothing more
    assert "".join(calls) == "ab" + "aabb|" + "aabb|" + "aabb" * 2
    assert set(out) == {"a", "b"} and rounds.result() == out


def test_a_curve_that_falls_with_size_is_not_extrapolated_downhill() -> None:
    """A noisy calibration (4 KiB slower than 16 KiB: a wake-up after the matmul round) must
    not make an 8-byte all-reduce slower still: below the range a monotone curve allows the
    faster of the two nearest points, above it the slower; a rising curve keeps alpha-beta."""
    noisy = Curve(((4096.0, 4e-3), (16384.0, 3e-4), (65536.0, 5e-4), (262144.0, 4e-4)))
    assert noisy.seconds(8.0) == pytest.approx(3e-4)
    assert noisy.seconds(2**20) == pytest.approx(5e-4)
    assert noisy.seconds(16384.0) == pytest.approx(3e-4)  # inside the range: as measured
    rising = Curve(((4096.0, 1e-4), (16384.0, 2e-4)))
    assert rising.seconds(8.0) == pytest.approx(1e-4 - 1e-4 * 4088 / 12288)
    assert rising.seconds(32768.0) == pytest.approx(2e-4 + 1e-4 * 16384 / 12288)

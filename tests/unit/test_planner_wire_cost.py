"""The calibrated message figures of measure/calibrate_wire.py in the cost model: pipeline
messages at the posted-receive curve ([Note: posted receives] in comm/probe.py), the
parameter server's fixed exchange ([Note: parameter-server exchange])."""

from __future__ import annotations

import pytest

from polytrain.planner.cluster import parse_cluster
from polytrain.planner.cost import Env, predict
from polytrain.planner.cost.ps import ps_step
from polytrain.planner.stats_pure import gpt_stats
from polytrain.planner.types import Curve, HostProfile, Layout
from tests.helpers.planner import cpu_profile

_PINGPONG = Curve(((4096.0, 1e-3), (2.0**20, 2e-3), (2.0**24, 1e-2)))
_POSTED = Curve(((4096.0, 1e-4), (2.0**20, 1e-3)))


def _profile(**extra: object) -> HostProfile:
    """`cpu_profile` with the ping-pong p2p curve and no concurrent rates (no shared-core
    slowdown), plus ``extra``."""
    fields: dict[str, object] = {"matmul_concurrent": {}, "collectives": {"p2p": {2: _PINGPONG}}}
    fields.update(extra)
    return cpu_profile(**fields)


def _posted_profile() -> HostProfile:
    return _profile(collectives={"p2p": {2: _PINGPONG}, "p2p_posted": {2: _POSTED}})


def test_a_pipeline_message_costs_the_posted_curve_up_to_its_largest_size() -> None:
    env = Env(parse_cluster("1x4xcpu"), profile=_posted_profile())
    assert env.posted_p2p_s(4096.0, 1) == pytest.approx(1e-4)
    assert env.posted_p2p_s(2.0**19, 1) == pytest.approx(_POSTED.seconds(2.0**19))
    # past the posted curve: bandwidth-bound, the ping-pong curve
    assert env.posted_p2p_s(2.0**22, 1) == pytest.approx(_PINGPONG.seconds(2.0**22))
    # an older profile without it: the ping-pong curve, as before
    old = Env(parse_cluster("1x4xcpu"), profile=_profile())
    assert old.posted_p2p_s(4096.0, 1) == pytest.approx(1e-3)
    # a message that leaves the calibrated host: the catalog's link, not the loopback curve
    two_hosts = Env(parse_cluster("2x2xcpu:eth10"), profile=_posted_profile())
    assert two_hosts.posted_p2p_s(4096.0, 2) == pytest.approx(two_hosts.p2p_s(4096.0, 2))


def test_pipeline_bubble_shrinks_with_the_posted_message_time() -> None:
    stats = gpt_stats(n_layer=4, n_embd=32, n_head=4, block_size=16, vocab_size=64)
    cluster = parse_cluster("1x2xcpu")
    layout = Layout(pp=2, microbatches=4)
    pingpong = predict(layout, stats, Env(cluster, profile=_profile()), 16)
    posted = predict(layout, stats, Env(cluster, profile=_posted_profile()), 16)
    # 1F1B on 2 stages: the messages on the critical path cost 0.1 ms instead of 1 ms each
    assert posted.breakdown["bubble"] < pingpong.breakdown["bubble"] - 2e-3
    assert posted.step_s < pingpong.step_s


def test_ps_exchange_is_linear_in_the_workers_between_and_past_the_measured_counts() -> None:
    figures = {"sync": {1: 2e-3, 2: 5e-3}, "async": {1: 3e-3}}
    env = Env(parse_cluster("1x4xcpu"), profile=_profile(ps_exchange_s=figures))
    assert env.ps_exchange_s("sync", 1) == pytest.approx(2e-3)
    assert env.ps_exchange_s("sync", 2) == pytest.approx(5e-3)
    assert env.ps_exchange_s("sync", 3) == pytest.approx(8e-3)  # each worker adds its share
    assert env.ps_exchange_s("async", 2) == pytest.approx(6e-3)  # one count: proportional
    assert env.ps_exchange_s("ssp", 1) == pytest.approx(3e-3)  # ssp runs async's exchange
    assert Env(parse_cluster("1x4xcpu"), profile=_profile()).ps_exchange_s("sync", 2) is None
    assert Env(parse_cluster("1x4xcpu")).ps_exchange_s("sync", 2) is None
    # workers and server on two hosts: the loopback probe does not describe them
    spread = Env(parse_cluster("2x2xcpu:eth10"), profile=_profile(ps_exchange_s=figures))
    assert spread.ps_exchange_s("sync", 3) is None


def test_ps_step_pays_the_calibrated_exchange_instead_of_the_link_latency() -> None:
    figures = {"sync": {1: 2e-3, 2: 5e-3}, "async": {1: 3e-3, 2: 9e-3}}
    env = Env(parse_cluster("1x4xcpu"), profile=_profile(ps_exchange_s=figures))
    bandwidth = env.link(1, 3).bandwidth
    g, compute = 4e5, 1e-3
    step, comm = ps_step(env, "sync", 2, 1, compute, g, g / 4, 2, 4)
    # the server's link carries both workers' pushes; the fixed exchange once per step
    assert comm == pytest.approx(2 * g / bandwidth + 5e-3)
    update = env.optimizer_s(g / 4, 2, 4)
    assert step == pytest.approx(compute + comm + update)
    a_step, _ = ps_step(env, "async", 2, 1, compute, g, g / 4, 2, 4)
    cycle = compute + g / bandwidth + 9e-3
    absorb = 2 * g / bandwidth + 9e-3 + 2 * update
    assert a_step == pytest.approx(max(cycle, absorb))
    uncalibrated = Env(parse_cluster("1x4xcpu"), profile=_profile())
    _, plain = ps_step(uncalibrated, "sync", 2, 1, compute, g, g / 4, 2, 4)
    link = uncalibrated.link(1, 3)
    assert plain == pytest.approx(2 * g / bandwidth + 2 * link.latency + link.base)

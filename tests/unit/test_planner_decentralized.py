"""`cost/decentralized.py`: gossip rounds and local SGD's average against hand-computed times."""

from __future__ import annotations

import pytest

from polytrain.config.io import job_from_dict, merge
from polytrain.planner.cluster import parse_cluster
from polytrain.planner.cost import Env, predict
from polytrain.planner.cost.decentralized import (
    gossip_exchange_s,
    localsgd_average_s,
    topology_fits,
)
from polytrain.planner.memory import memory_per_rank
from polytrain.planner.search import PlanRequest, search
from polytrain.planner.stats_pure import gpt_stats
from polytrain.planner.types import Layout

X = 4e6  # bytes of the flat model


def test_a_gossip_round_in_one_host_costs_one_p2p_per_neighbour() -> None:
    env = Env(parse_cluster("1x4xA100-40GB"))
    p2p = env.p2p_s(X, 1)
    mix = lambda degree: (degree + 2) * X / env.mem_bw  # noqa: E731
    assert gossip_exchange_s(env, "ring", 4, X) == pytest.approx(2 * p2p + mix(2))
    assert gossip_exchange_s(env, "complete", 4, X) == pytest.approx(3 * p2p + mix(3))
    # exponential on 4: i -> i+1, i+2 (directed, two out- and two in-neighbours)
    assert gossip_exchange_s(env, "exponential", 4, X) == pytest.approx(2 * p2p + mix(2))
    assert gossip_exchange_s(env, "ring", 1, X) == 0.0


def test_messages_across_hosts_share_the_host_nic() -> None:
    """Ring 0-1-2-3 over two hosts of two: 1->2 and 0->3 leave host 0 together, so each gets
    half of its link; node 1 also sends to 0 inside the host."""
    env = Env(parse_cluster("2x2xcpu:eth10"))
    inter = env.cluster.inter
    assert inter is not None and env.cluster.nic == "host"
    cross = X * 2 / inter.bandwidth + inter.latency + inter.base
    expected = env.p2p_s(X, 1) + cross + 4 * X / env.mem_bw
    assert gossip_exchange_s(env, "ring", 4, X) == pytest.approx(expected)


def test_localsgd_amortizes_one_all_reduce_over_its_period() -> None:
    env = Env(parse_cluster("1x4xA100-40GB"))
    assert localsgd_average_s(env, 4, X, 8) == pytest.approx(
        env.collective_s("all_reduce", X, 4, 1) / 8
    )
    assert topology_fits("torus", 4) and not topology_fits("torus", 3)


def test_decentralized_layouts_are_priced_only_when_asynchrony_is_allowed() -> None:
    stats = gpt_stats(n_layer=2, n_embd=64, n_head=4, block_size=16, vocab_size=64)
    cluster = parse_cluster("1x4xcpu")
    base = PlanRequest(stats=stats, cluster=cluster, global_batch=16, steps=10)
    names = {p.layout.describe() for p in search(base).plans}
    assert not any(n.startswith(("gossip", "localsgd")) for n in names)
    allowed = search(PlanRequest(stats=stats, cluster=cluster, global_batch=16, steps=10,
                                 allow_async=True, localsgd_period=4))  # fmt: skip
    names = {p.layout.describe() for p in allowed.plans}
    assert {"gossip-ring-w4", "gossip-torus-w4", "localsgd-h4-w4"} <= names
    assert "gossip-torus-w3" not in names  # 3 ranks make no torus
    # every decentralized plan is a job the runtime accepts
    for plan in allowed.plans:
        if plan.layout.sync in ("gossip", "localsgd"):
            data: dict[str, object] = {}
            for key, value in plan.layout.overrides().items():
                merge(data, key.split("."), value)
            job = job_from_dict(data)
            assert job.parallel.sync == plan.layout.sync and job.world_size == plan.devices


def test_gossip_step_and_memory_add_the_exchange_to_a_replica() -> None:
    stats = gpt_stats(n_layer=2, n_embd=64, n_head=4, block_size=16, vocab_size=64)
    env = Env(parse_cluster("1x4xA100-40GB"))
    dp = predict(Layout(dp=4), stats, env, 16)
    ring = predict(Layout(dp=4, sync="gossip", topology="ring"), stats, env, 16)
    exchange = gossip_exchange_s(env, "ring", 4, float(stats.param_bytes))
    assert ring.breakdown["dp_comm"] == pytest.approx(exchange)
    assert ring.breakdown["compute"] == pytest.approx(dp.breakdown["compute"])
    mem = memory_per_rank(stats, Layout(dp=4, sync="gossip"), [stats.blocks], 4.0)
    plain = memory_per_rank(stats, Layout(dp=4), [stats.blocks], 4.0)
    assert mem.buffers - plain.buffers == pytest.approx(4 * stats.param_bytes)  # 2 in + 2

"""Decentralized replicas: gossip over a peer graph and local SGD's periodic average.

Both run whole-model replicas (``parallel.sync = "gossip" | "localsgd"``, tp = pp = 1), each on
``global_batch / N`` samples: a local forward and backward, the end of step (non-finite check,
one all-reduce of [loss, flag] over the world, clip, optimizer), then the strategy's exchange,
which nothing overlaps (`gossip.replica.ReplicaStrategy._update` runs it after the optimizer).
Derivation: docs/planner.md "Decentralized".

* gossip (D-PSGD, Lian et al. NeurIPS 2017; SGP, Assran et al. ICML 2019): every step each node
  posts one message of the flat model (P bytes) to each of its out-neighbours and receives one
  from each in-neighbour, all at once (`comm.gossip_wire.exchange`), then mixes: a node's round
  costs ``sum over its messages of X / B_edge`` plus one latency per message, on the busier of
  its send and receive sides, and the step waits for the slowest node (its neighbours wait for
  its message). Inside a host an edge is priced as one p2p (the calibrated curve when there is
  one); an edge across hosts shares the host's NIC (``nic = "host"``) with the other edges
  leaving that host in the same round, or has the device's own (``nic = "device"``). Mixing is
  memory-bound: read the received buffers and the model, write the model.
* localsgd (Stich ICLR 2019; Lin et al. ICLR 2020): H local steps, then one all-reduce of the
  flat model over the world (torch's `PeriodicModelAverager`): ``all_reduce(P, N) / H`` per step.
"""

from __future__ import annotations

from polytrain.gossip.graphs import graph_for_round, torus_shape
from polytrain.planner.cost.common import Env, Shape
from polytrain.planner.cost.parts import end_of_step_s, loop_s
from polytrain.planner.types import Layout, ModelStats

__all__ = [
    "TOPOLOGIES",
    "gossip_exchange_s",
    "localsgd_average_s",
    "replicas_step",
    "topology_fits",
]

TOPOLOGIES = ("ring", "torus", "exponential", "complete")  # fixed graphs; random is not priced


def topology_fits(topology: str, n: int) -> bool:
    """Whether the runtime accepts ``topology`` on ``n`` ranks (`check_decentralized`)."""
    if n < 2:
        return False
    return topology != "torus" or torus_shape(n) is not None


def gossip_exchange_s(env: Env, topology: str, n: int, model_bytes: float) -> float:
    """Seconds of one gossip round on ``n`` ranks with ``model_bytes`` per message (the
    slowest node's send or receive side, plus its mixing). Ranks are laid out host by host."""
    if n < 2 or model_bytes <= 0:
        return 0.0
    graph = graph_for_round(topology, n, 0)
    cluster = env.cluster
    host = [i // cluster.per_host for i in range(n)]
    edges = [(i, j) for i, outs in enumerate(graph.out) for j in outs]
    egress: dict[int, int] = {}  # host -> messages leaving it this round
    ingress: dict[int, int] = {}  # host -> messages arriving at it
    for i, j in edges:
        if host[i] != host[j]:
            egress[host[i]] = egress.get(host[i], 0) + 1
            ingress[host[j]] = ingress.get(host[j], 0) + 1
    send = [0.0] * n
    recv = [0.0] * n
    for i, j in edges:
        if host[i] == host[j] or cluster.inter is None:
            secs = env.p2p_s(model_bytes, 1)
        else:
            link = cluster.inter
            share = 1
            if cluster.nic == "host":  # one full-duplex NIC per host, shared by its messages
                share = max(egress[host[i]], ingress[host[j]])
            secs = model_bytes * share / link.bandwidth + link.latency + link.base
        send[i] += secs
        recv[j] += secs
    in_degree = max(len(graph.in_neighbours(i)) for i in range(n))
    mixing = (in_degree + 2) * model_bytes / env.mem_bw * env.cpu_slowdown
    return max(max(send), max(recv)) + mixing


def localsgd_average_s(env: Env, n: int, model_bytes: float, period: int) -> float:
    """Per-step share of local SGD's world average: one all-reduce of the model every H steps."""
    if n < 2 or period < 1:
        return 0.0
    return env.collective_s("all_reduce", model_bytes, n, 1) / period


def replicas_step(
    layout: Layout, stats: ModelStats, env: Env, shape: Shape
) -> tuple[float, dict[str, float]]:
    """Whole-model replicas (the decentralized family's registry row names this module): local
    compute, the end of step, then the exchange (a gossip round or local SGD's amortized
    average), nothing overlapped."""
    replica_samples = shape.replica_samples
    compute = sum(
        env.fwd_s(b, replica_samples) + env.bwd_s(b, replica_samples) for b in stats.blocks
    )
    opt = end_of_step_s(layout, stats, env, stats.blocks)
    per_step, per_micro = loop_s(env)  # see `cost.parts.loop_s`
    loop = per_step + per_micro
    model_bytes = float(stats.param_bytes)  # the flat fp32 model (gossip.compress = "none")
    if layout.sync == "gossip":
        comm = gossip_exchange_s(env, layout.topology, layout.dp, model_bytes)
    else:
        comm = localsgd_average_s(env, layout.dp, model_bytes, layout.period)
    return compute + opt + comm + loop, {
        "compute": compute,
        "tp_comm": 0.0,
        "dp_comm": comm,
        "bubble": 0.0,
        "optimizer": opt,
        "loop": loop,
    }

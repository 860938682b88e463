"""Parameter servers (sync, async, SSP): N workers pushing into K server ranks.

Li et al., "Scaling Distributed Machine Learning with the Parameter Server", OSDI 2014; Ho et
al., "More Effective Distributed ML via a Stale Synchronous Parallel Parameter Server", NIPS
2013. Each worker pushes its gradient (G bytes) and pulls the parameters (P bytes) every step,
in chunks of ``ps.chunk_kb``, to and from K servers that each hold 1/K of the model.
Derivation: docs/planner.md "Parameter servers".

* A worker's link carries G out and P in at once (full duplex): ``max(G, P) / B``.
* A server's link carries N G / K in and N P / K out: ``N max(G, P) / (K B)``; with N > K the
  servers' links, not the workers', bound the exchange ("server bandwidth").
* sync: every step waits for all workers (and for the slowest: ``straggler_s``), then the
  servers apply one update of their shard.
* async / ssp: workers never wait for each other; a global step (the global batch) costs the
  larger of one worker's cycle and the servers' time to absorb N pushes and apply N updates.
  The slowest worker slows only its own share (``straggler_s / N``). With equal workers SSP's
  bound is never reached, so it costs what async costs.
* leaf servers (``ps.leaves``, Rudra; Gupta et al. ICDM 2016): groups of ``g`` workers exchange
  with their leaf over the group's link, and the root exchanges with ``L = N / g`` leaves over
  the world's: the root's traffic falls by ``g``. One level after the other in sync (the leaf
  pushes up only when its group is in, and grants only what it pulled); async and SSP groups are
  sync inside, and the root absorbs ``L`` pushes per global step.
"""

from __future__ import annotations

from dataclasses import replace

from polytrain.planner.cost.common import Env, Shape
from polytrain.planner.cost.parts import loop_s
from polytrain.planner.types import Layout, ModelStats

__all__ = ["ps_layout_step", "ps_step"]


def ps_step(
    env: Env,
    mode: str,
    workers: int,
    servers: int,
    compute_s: float,
    param_bytes: float,
    params: float,
    state_per_param: int,
    dtype_bytes: int,
    *,
    tensors: float = 0.0,
    optimizer: str = "adamw",
    per_leaf: int = 0,
) -> tuple[float, float]:
    """(seconds per global step, seconds of it spent on communication); ``per_leaf``: workers
    per leaf server (0: the workers push to the servers themselves)."""
    world = workers + servers
    link = env.link(1, world)
    # Chunks are pipelined (a chunk is on the wire while the next is packed), so latency is
    # paid once per push and pull per server, not per chunk. On the calibrated host the fixed
    # exchange measured on a probe replaces it ([Note: parameter-server exchange] in
    # measure/calibrate_wire.py: messages, headers, the server's threads, for N workers).
    fixed = env.ps_exchange_s(mode, workers)
    latency = 2 * servers * link.latency + link.base if fixed is None else fixed
    worker_s = param_bytes / link.bandwidth + latency
    server_s = workers * param_bytes / (servers * link.bandwidth) + latency
    exchange = max(worker_s, server_s)
    pushers = workers
    if per_leaf:
        pushers = -(-workers // per_leaf)  # L leaves
        group = env.link(1, per_leaf)
        fixed_group = env.ps_exchange_s("sync", per_leaf)
        group_latency = 2 * group.latency + group.base if fixed_group is None else fixed_group
        fixed = env.ps_exchange_s(mode, pushers)
        latency = 2 * servers * link.latency + link.base if fixed is None else fixed
        # level 1: a worker and its leaf (the leaf's link carries its group's g pushes)
        in_group = per_leaf * param_bytes / group.bandwidth + group_latency
        # level 2: a leaf (one push) and the root servers (L pushes over K)
        worker_s = param_bytes / link.bandwidth + latency
        server_s = pushers * param_bytes / (servers * link.bandwidth) + latency
        exchange = in_group + max(worker_s, server_s)
        worker_s += in_group  # a group's round trip to the root
    update = env.optimizer_s(
        params / servers,
        state_per_param,
        dtype_bytes,
        tensors=tensors / servers,
        optimizer=optimizer,
        fused=True,  # [Note: fused server optimizer] in ps/shard.py
    )
    if mode == "sync":
        step = compute_s + env.straggler_s + exchange + update
        return step, exchange
    cycle = compute_s + env.straggler_s / pushers + worker_s
    absorb = server_s + pushers * update
    if absorb > cycle:  # server-bound
        return absorb, absorb - compute_s
    return cycle, worker_s


def ps_layout_step(
    layout: Layout, stats: ModelStats, env: Env, shape: Shape
) -> tuple[float, dict[str, float]]:
    """Step seconds and breakdown of a parameter-server ``layout`` (its registry row names
    this module): the workers' compute, then `ps_step`'s exchange."""
    replica_samples = shape.replica_samples
    # The servers wait on the network while the workers compute: only workers share the cores.
    env = replace(env, computing=min(layout.dp, env.cluster.per_host))
    compute = sum(
        env.fwd_s(b, replica_samples) + env.bwd_s(b, replica_samples) for b in stats.blocks
    )
    # a worker checks and clips its gradient before it pushes (core.step.apply_update)
    tensors = sum(b.tensors for b in stats.blocks)
    parts = ("check", "clip") if stats.grad_clip else ("check",)
    compute += env.step_cost_s(parts, tensors, float(stats.param_bytes))
    per_step, per_micro = loop_s(env)  # a worker's own loop (see `cost.parts.loop_s`)
    loop = per_step + per_micro
    # sync: every worker waits for the slowest at the servers each step ([Note: ranks' skew])
    skew = env.skew_s(compute, layout.dp) if layout.ps_mode == "sync" else 0.0
    compute += loop + skew
    step, comm = ps_step(
        env,
        layout.ps_mode,
        layout.dp,
        max(layout.ps_servers, 1),
        compute,
        float(stats.param_bytes),
        float(stats.params),
        stats.optimizer_state_per_param,
        stats.dtype_bytes,
        tensors=tensors,
        optimizer=stats.optimizer,
        per_leaf=layout.ps_leaves,
    )
    return step, {
        "compute": compute - loop - skew,
        "tp_comm": 0.0,
        "dp_comm": comm,
        "bubble": 0.0,
        "optimizer": 0.0,
        "loop": loop,
        "skew": skew,
    }

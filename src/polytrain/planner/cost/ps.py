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
"""

from __future__ import annotations

from polytrain.planner.cost.common import Env

__all__ = ["ps_step"]


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
) -> tuple[float, float]:
    """(seconds per global step, seconds of it spent on communication)."""
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
    update = env.optimizer_s(
        params / servers,
        state_per_param,
        dtype_bytes,
        tensors=tensors / servers,
        optimizer=optimizer,
        fused=True,  # [Note: fused server optimizer] in ps/server.py
    )
    if mode == "sync":
        step = compute_s + env.straggler_s + exchange + update
        return step, exchange
    cycle = compute_s + env.straggler_s / workers + worker_s
    absorb = server_s + workers * update
    if absorb > cycle:  # server-bound
        return absorb, absorb - compute_s
    return cycle, worker_s

"""`polytrain calibrate`'s message probes: the pipeline's posted p2p and the parameter server's
per-step exchange (called by `measure.calibrate`, which keeps the rest of the host's numbers).

[Note: parameter-server exchange] A parameter-server step costs, beyond its bytes, a fixed
exchange that does not shrink with the model: the worker's headers (one per chunk, a CLOCK;
each encoded, sent, decoded and validated), the server's receiver thread waking per message and
handing it to the server's main thread through a queue, the server's wake-ups to apply the update
and answer the pull, and each gloo message's trip between processes that are asleep in a wait
([Note: posted receives] in comm/probe.py: on a 2-core VM a trip is 0.1 ms or 1-3 ms). The
cost model cannot count those trips from the protocol: which of them overlap and which wait
depends on the threads' timing. So `polytrain calibrate` runs the real `PSStrategy` (one server,
1 and 2 workers, sync and async) on `_PROBE_MODEL`, whose compute and bytes are negligible, and
keeps each worker's seconds per step less what the cost model already prices for that step:
the loop's own Python ([Note: loop overhead] in measure/calibrate_worker.py) and its operator calls x
``op_s``. What is left is the exchange's fixed seconds with N workers at one server
(`HostProfile.ps_exchange_s`); `Env.ps_exchange_s` reads it at N, linear between and past the
measured counts (the server's one main thread serves its workers' messages in turn, so each
worker adds its share). Measured with the workers sharing the cores as they do in a job, so
no shared-core slowdown is applied on top. Measured on the 2-core VM over nine calibrations
(each the median of its launches, the host shared with other jobs): sync 1.9-7.2 ms with 1
worker and 4.8-10.7 ms with 2; async 2.3-7.5 and 5.4-11.0 ms. Async did more per step than
sync while it posted no pull with its push: each step paid a blocking push and then a separate
PULL request and reply, none of it overlapped with compute (the mlp's async step took 15.5 ms
against sync's 9.1 in a quiet benchmark run); since 2026-11-25 it posts its next pull right
after its push ([Note: pull with the clock] in ps/overlap.py), and the probe measures that.
"""

from __future__ import annotations

import statistics
import time
from typing import Literal

import torch

from polytrain.comm.init import init_distributed
from polytrain.comm.probe import time_p2p_posted
from polytrain.config.job import (
    JobConfig,
    LaunchConfig,
    ModelConfig,
    ObserveConfig,
    ParallelConfig,
    PSConfig,
    TrainConfig,
)
from polytrain.core.optim import lr_at
from polytrain.data.datasets import build_datasets
from polytrain.data.sampler import Batches
from polytrain.measure.kernels import OpCounter
from polytrain.measure.timing import median_and_spread
from polytrain.models.registry import block_size_of, build_model
from polytrain.ps.strategy import PSStrategy
from polytrain.testing.harness import run_distributed

__all__ = ["PS_PROBE_WORKERS", "posted_p2p_curve", "ps_exchange", "rank_p2p_posted"]

PS_PROBE_WORKERS = (1, 2)  # workers at one server: the fixed exchange's two points
_PS_WARMUP, _PS_STEPS = 8, 64
# launches of each (mode, workers), interleaved: a launch's processes may all land in the slow
# or the fast mode of the host's wake-ups, so the figure is the median over launches
_PS_ROUNDS = 3
_MODES: tuple[Literal["sync", "async"], ...] = ("sync", "async")
POSTED_MAX_BYTES = 1 << 20  # larger messages are bandwidth-bound: the ping-pong curve holds
_POSTED_ROUNDS = 5
_PROBE_MODEL = ModelConfig(name="mlp", n_layer=1, n_embd=1, block_size=1)


def rank_p2p_posted(
    rank: int, world: int, sizes: tuple[int, ...]
) -> tuple[list[tuple[float, float]], float]:
    """((bytes, one-way seconds) of a message whose receive is posted, spread): each size timed
    once per round, `_POSTED_ROUNDS` rounds, the median ([Note: posted receives] in
    comm/probe.py; [Note: timing rounds] in measure/timing.py)."""
    init_distributed()
    wanted = [n for n in sizes if n <= POSTED_MAX_BYTES]
    times: dict[int, list[float]] = {n: [] for n in wanted}
    for n in wanted:  # warm-up: connection and buffers
        time_p2p_posted(n, round_trips=2)
    for _ in range(_POSTED_ROUNDS):
        for n in wanted:
            times[n].append(time_p2p_posted(n))
    curve, spreads = [], []
    for n, values in times.items():
        secs, spread = median_and_spread(values)
        curve.append((float(n), secs))
        spreads.append(spread)
    return curve, statistics.median(spreads) if spreads else 0.0


def _ps_job(mode: Literal["sync", "async"], workers: int) -> JobConfig:
    return JobConfig(
        model=_PROBE_MODEL,
        train=TrainConfig(steps=_PS_WARMUP + _PS_STEPS, sample_tokens=0, eval_every=0),
        parallel=ParallelConfig(dp=workers, sync="ps"),
        # one chunk per push and pull; an explicit size keeps the probe off the saved profile
        ps=PSConfig(servers=1, mode=mode, chunk_kb=64),
        observe=ObserveConfig(progress=False),
        launch=LaunchConfig(nproc=workers + 1),
    )


def rank_ps_exchange(
    rank: int, world: int, mode: Literal["sync", "async"], op_s: float, loop_s: float
) -> tuple[float, float] | None:
    """[Note: parameter-server exchange] On a worker: (seconds per step of the exchange beyond
    ``loop_s`` (the calibrated loop overhead of one micro-batch step) and the step's operator
    calls x ``op_s``, spread); None on the server."""
    ctx = init_distributed()
    torch.manual_seed(0)
    job = _ps_job(mode, world - 1)
    train_set, val_set, spec = build_datasets(job.data, block_size_of(job.model))
    batches = Batches(train_set, val_set, job.train.global_batch_size, job.train.seed)
    model = build_model(job.model, spec, job.train.seed)
    strategy = PSStrategy(job, ctx.rank, ctx.world_size, model, batches)
    priced = loop_s
    if not strategy.is_server:
        x, y = batches.train(0, rank, world - 1, 0, 1)
        counter = OpCounter()
        with counter:
            model.loss(model(x), y).backward()
        model.zero_grad(set_to_none=True)
        priced += counter.ops * op_s
    seconds: list[float] = []
    for step in range(job.train.steps):
        t0 = time.perf_counter()
        strategy.set_lr(lr_at(step, job.optim, job.train.steps))
        strategy.train_step(step)
        if step >= _PS_WARMUP:
            seconds.append(time.perf_counter() - t0)
    strategy.full_state_dict()  # every worker leaves; the server stops
    if strategy.is_server:
        return None
    secs, spread = median_and_spread(seconds)
    return max(secs - priced, 0.0), spread


def posted_p2p_curve(sizes: tuple[int, ...]) -> tuple[list[tuple[float, float]], float]:
    """[Note: posted receives]: (bytes, one-way seconds) up to `POSTED_MAX_BYTES`, spread."""
    curve, spread = run_distributed(rank_p2p_posted, 2, sizes, timeout_s=300.0)[0]
    return curve, spread


def ps_exchange(
    op_s: float, loop_s: float, workers: tuple[int, ...], rounds: int = _PS_ROUNDS
) -> tuple[dict[str, dict[int, float]], dict[str, float]]:
    """[Note: parameter-server exchange]: (mode -> workers -> seconds, name -> spread): per
    (mode, workers) the median over ``rounds`` launches of the slowest worker's figure; its
    spread the largest of its launches'."""
    seen: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for _ in range(rounds):
        for mode in _MODES:
            for n in workers:
                results = run_distributed(
                    rank_ps_exchange, n + 1, mode, op_s, loop_s, timeout_s=300.0
                )
                figures = [r for r in results if r is not None]
                seen.setdefault((mode, n), []).append(max(figures))
    out: dict[str, dict[int, float]] = {}
    spread: dict[str, float] = {}
    for (name, n), values in seen.items():
        out.setdefault(name, {})[n] = statistics.median(v[0] for v in values)
        spread[f"ps exchange {name} x{n}"] = max(v[1] for v in values)
    return out, spread

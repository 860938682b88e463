"""What a training worker itself costs, for `polytrain calibrate`: its loop's own Python per step
and per micro-batch ([Note: loop overhead]), the pipeline runtime's per action and per flush
([Note: pipeline runtime overhead]) and a rank's memory once it joined a group (`rank_baseline`;
a fresh worker's own: `planner.worker_memory`). Moved out of `measure.calibrate`, which runs them
and keeps their figures in the `HostProfile`.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

import polytrain.parallel
import polytrain.pipeline
import polytrain.ps  # noqa: F401  (with the two above: what a worker imports, for its baseline)
from polytrain.comm.init import init_distributed
from polytrain.config.job import (
    JobConfig,
    LaunchConfig,
    ModelConfig,
    ObserveConfig,
    ParallelConfig,
    PipelineConfig,
    TrainConfig,
)
from polytrain.core.optim import lr_at
from polytrain.core.strategy import Strategy, step_result
from polytrain.data.datasets import build_datasets
from polytrain.data.sampler import Batches
from polytrain.measure.kernels import OpCounter
from polytrain.measure.stats import model_stats
from polytrain.measure.timing import Rounds, median_and_spread
from polytrain.models.registry import block_size_of, build_model
from polytrain.observe.metrics import peak_memory_mb
from polytrain.parallel.family import build_spmd
from polytrain.pipeline.family import build_pipeline
from polytrain.planner.cluster import parse_cluster
from polytrain.planner.cost import Env, predict
from polytrain.planner.types import HostProfile, Layout

__all__ = [
    "PIPE_MICROBATCHES",
    "fit_pipeline_runtime",
    "pipeline_probe_job",
    "rank_baseline",
    "rank_loop_overhead",
    "rank_pipeline_steps",
]


# [Note: loop overhead] The job whose step costs next to nothing: gpt's sibling mlp with one hidden
# layer of one unit on one-token windows (its forward and backward are ~50 operator calls on
# tensors of a few values), on the default data set and optimizer, one rank, no strategy wrapper.
_LOOP_ACCUM = (1, 8)  # micro-steps per step: the per-step and per-micro-batch terms' two points


def _loop_job(accum: int) -> JobConfig:
    return JobConfig(
        model=ModelConfig(name="mlp", n_layer=1, n_embd=1, block_size=1),
        train=TrainConfig(grad_accum=accum, sample_tokens=0, eval_every=0),
        parallel=ParallelConfig(dp=1),
        observe=ObserveConfig(progress=False),
        launch=LaunchConfig(nproc=1),
    )


def rank_loop_overhead(
    rank: int, world: int, budget_s: float, op_s: float, step_costs: dict[str, tuple[float, float]]
) -> tuple[float, float, float]:
    """[Note: loop overhead] (seconds per step, seconds per micro-batch, spread) of what a
    training step spends beyond what the cost model prices, on a one-rank group: the trainer's
    ``set_lr`` and the strategy's real ``train_step`` of a model that costs next to nothing
    (`_loop_job`), at 1 and 8 micro-steps per step, less what the cost model prices for that
    same step (its operator calls x ``op_s``, the calibrated end of step over its tensors).
    What is left is the step's own Python: fetching and collating the batch, ``zero_grad``,
    ``model.train()``, the autograd engine's start per backward, the loss's stack, reduce and
    ``.item()``, the tracer's spans, the strategy's wrapper. The two step counts run in the
    same rounds ([Note: timing rounds]), and each round's pair of residuals gives a per-step
    constant and a per-micro-batch slope: the answer is their medians over the rounds (each
    at least 0), so load that slows one round slows both of its points alike."""
    ctx = init_distributed()
    device = ctx.device
    torch.manual_seed(0)
    steps: dict[int, Callable[[], object]] = {}
    priced: dict[int, float] = {}
    for accum in _LOOP_ACCUM:
        job = _loop_job(accum)
        train_set, val_set, spec = build_datasets(job.data, block_size_of(job.model))
        batches = Batches(train_set, val_set, job.train.global_batch_size, job.train.seed)
        model = build_model(job.model, spec, job.train.seed)
        strategy = build_spmd(job, ctx, model, batches)  # dp1: the plain model

        def step(
            strategy: Strategy = strategy,
            job: JobConfig = job,
            count: Iterator[int] = itertools.count(),
        ) -> None:
            n = next(count)
            strategy.set_lr(lr_at(n, job.optim, job.train.steps))
            strategy.train_step(n)

        steps[accum] = step
        x, y = batches.train(0, microbatch=0, num_microbatches=accum)
        counter = OpCounter()
        with counter:
            model.loss(model(x), y).backward()
        params = [prm for prm in model.parameters() if prm.requires_grad]
        nbytes = float(sum(prm.numel() * prm.element_size() for prm in params))
        end = sum(
            a * len(params) + b * nbytes
            for part, (a, b) in step_costs.items()
            if part in (job.optim.name, "check", "clip")
        )
        priced[accum] = accum * counter.ops * op_s + end
    rounds = Rounds(steps, device, budget_s, max_calls=250)  # steps of ~1 ms: fill the budget
    spread = max(s for _, s in rounds.result().values())
    lo, hi = _LOOP_ACCUM
    per_step, per_micro = [], []
    for t_lo, t_hi in zip(rounds.per_round[lo], rounds.per_round[hi], strict=True):
        slope = ((t_hi - priced[hi]) - (t_lo - priced[lo])) / (hi - lo)
        per_micro.append(slope)
        per_step.append(t_lo - priced[lo] - lo * slope)
    return (
        max(statistics.median(per_step), 0.0),
        max(statistics.median(per_micro), 0.0),
        spread,
    )


# [Note: pipeline runtime overhead] A pipeline stage runs every F and B through its runtime
# (pipeline/runtime.py): the action's span, the stage's call, the received activation's
# ``requires_grad_``, the backward with its incoming gradient, the sends it posts and the
# receives it takes; and a rank that blocks on a message must be woken when it arrives, and on
# the 2-core VM some messages come 2-4 ms late (docs/planner.md "Pipeline").
# None of it is the model's compute or the loop's per-micro-batch Python ([Note: loop
# overhead]). Measured on that VM (2026-11-26) with the negligible model below on two stages, a
# GPipe step took 3.1-4.1 ms at 2 micro-batches and 7.5-10.6 ms at 8, 1F1B 2.8-4.1 and 6.2-8.1,
# where the runtime's own trace showed each F and B at 0.2-0.3 ms: the cost model without these
# terms priced the mlp tiny's pipelines 15-42% low. The probe runs the runtime's real
# ``train_step`` (after ``set_lr``, as the loop does) of that model on two stages, every schedule
# at 2 and 8 micro-batches, in rounds (each round the mean of its steps, as a trial measures a
# run: a stall of a few ms is part of the price), and solves, round by round, for the seconds
# added to every F and B (action) and to every flush (flush) that make the cost model's own
# price of that very job equal what was measured at both counts:
#     price(m; action, flush) = t(m),  m = 2, 8
# (the figures enter the model exactly so; the price is linear in both but for the shared
# cores, [Note: a pipeline's shared cores] in cost/stages.py, so Newton's method on finite
# differences). The figures are their medians over the rounds, at least 0 (a negative action
# refits the flush alone).
# They are priced as measured, not slowed by the shared cores: most of a negligible stage's
# action is waiting, and with the factor on, one calibration's figures priced mlp tiny's
# 4-process pipelines (pp4, dp2 x pp2) 56-75% high, without it 33-34%. The figure moves with
# the host: 81-197 us per action one calibration, 213-286 us another an hour later (same VM,
# nothing else running; the rounds' spread 45-58%).
PIPE_MICROBATCHES = (2, 8)
_PIPE_ROUNDS = 6  # after one round of warm-up


def pipeline_probe_job(schedule: str, microbatches: int, steps_per_round: int = 1) -> JobConfig:
    """[Note: pipeline runtime overhead]: the negligible model (gpt's sibling mlp, two layers of
    one unit on one-token windows) on two stages, as many steps as the probe's rounds take."""
    return JobConfig(
        model=ModelConfig(name="mlp", n_layer=2, n_embd=1, block_size=1),
        train=TrainConfig(
            steps=(_PIPE_ROUNDS + 1) * steps_per_round, sample_tokens=0, eval_every=0
        ),
        parallel=ParallelConfig(pp=2),
        pipeline=PipelineConfig(schedule=schedule, microbatches=microbatches),  # type: ignore[arg-type]  # SCHEDULE_NAMES
        observe=ObserveConfig(progress=False),
        launch=LaunchConfig(nproc=2),
    )


def rank_pipeline_steps(
    rank: int, world: int, schedules: tuple[str, ...], steps_per_round: int
) -> dict[tuple[str, int], list[float]]:
    """[Note: pipeline runtime overhead] (schedule, micro-batches) -> mean seconds of a step, per
    round of ``steps_per_round`` steps. Every rank runs the same steps in the same order; a
    PipeDream stream left open between rounds stays on its own process groups
    (`comm.p2p.new_group_of`)."""
    ctx = init_distributed()
    torch.manual_seed(0)
    runs: dict[tuple[str, int], tuple[Strategy, JobConfig]] = {}
    for schedule in schedules:
        for m in PIPE_MICROBATCHES:
            job = pipeline_probe_job(schedule, m, steps_per_round)
            train_set, val_set, spec = build_datasets(job.data, block_size_of(job.model))
            batches = Batches(train_set, val_set, job.train.global_batch_size, job.train.seed)
            model = build_model(job.model, spec, job.train.seed)
            runs[(schedule, m)] = (build_pipeline(job, ctx, model, batches), job)
    per_round: dict[tuple[str, int], list[float]] = {key: [] for key in runs}
    for r in range(_PIPE_ROUNDS + 1):
        for key, (strategy, job) in runs.items():
            total = 0.0
            for n in range(r * steps_per_round, (r + 1) * steps_per_round):
                t0 = time.perf_counter()
                strategy.set_lr(lr_at(n, job.optim, job.train.steps))
                out = strategy.train_step(n)
                total += time.perf_counter() - t0
                step_result(out)  # PipeDream's deferred loss (the loop waits a step later)
            if r:
                per_round[key].append(total / steps_per_round)
    return per_round


def fit_pipeline_runtime(
    profile: HostProfile, measured: dict[tuple[str, int], list[float]]
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """[Note: pipeline runtime overhead] (schedule -> seconds per F and B, schedule -> seconds
    per flush, "pipeline runtime <schedule>" -> spread of the per-action figure's rounds)."""
    host = parse_cluster("1x2xcpu")
    actions: dict[str, float] = {}
    flushes: dict[str, float] = {}
    spreads: dict[str, float] = {}
    stats = model_stats(pipeline_probe_job("1f1b", 2), device="cpu")  # one model for all
    for schedule in sorted({s for s, _ in measured}):

        def price(m: int, action: float, flush: float, schedule: str = schedule) -> float:
            job = pipeline_probe_job(schedule, m)
            prof = replace(
                profile, pipe_action_s={schedule: action}, pipe_flush_s={schedule: flush}
            )
            env = Env(host, job.train.dtype, prof, job.parallel.bucket_mb * 2**20)
            layout = Layout(pp=2, schedule=schedule, microbatches=m)
            return predict(layout, stats, env, job.train.global_batch_size).step_s

        rounds = zip(*(measured[(schedule, m)] for m in PIPE_MICROBATCHES), strict=True)
        fits = [_solve(price, dict(zip(PIPE_MICROBATCHES, r, strict=True))) for r in rounds]
        action, spreads[f"pipeline runtime {schedule}"] = median_and_spread([a for a, _ in fits])
        actions[schedule] = max(action, 0.0)
        if action < 0:  # no action: the flush alone, from every round and count
            fits = [
                _solve(price, {m: t}, action=0.0)
                for m in PIPE_MICROBATCHES
                for t in measured[(schedule, m)]
            ]
        flushes[schedule] = max(statistics.median(f for _, f in fits), 0.0)
    return actions, flushes, spreads


def _solve(
    price: Callable[[int, float, float], float],
    seconds: dict[int, float],
    action: float | None = None,
) -> tuple[float, float]:
    """(action, flush) with ``price(m, action, flush) == seconds[m]`` for each micro-batch count
    m: Newton's method from (0, 0) on finite differences (the price is nearly linear in both:
    on shared cores the ranks' utilization moves with the runtime's share); it stops at a
    negative action. With ``action`` given, the flush alone from one count."""
    eps, a, f = 1e-6, action or 0.0, 0.0
    for _ in range(6):
        rows = []
        for m, t in seconds.items():
            base = price(m, a, f)
            rows.append(
                (
                    (price(m, a + eps, f) - base) / eps,
                    (price(m, a, f + eps) - base) / eps,
                    t - base,
                )
            )
        if action is not None:
            _, df, r = rows[0]
            f += r / df
            continue
        (a1, f1, r1), (a2, f2, r2) = rows
        det = a1 * f2 - a2 * f1
        if det == 0:
            break
        a += (r1 * f2 - r2 * f1) / det
        f += (a1 * r2 - a2 * r1) / det
        if a < 0:  # no runtime cost to add: the caller refits the flush alone
            break
    return a, f


def rank_baseline(rank: int, world: int) -> float:
    """Peak resident bytes of a worker that imported the strategy packages and joined the group (the
    trainer's own measure, `observe.metrics.peak_memory_mb`: see its [Note: inherited maxrss])."""
    return peak_memory_mb(torch.device("cpu")) * 2**20

"""What a training worker itself costs, for `polytrain calibrate`: its loop's own Python per step
and per micro-batch ([Note: loop overhead]) and the memory it holds before it builds a model
([Note: a worker's own memory] in planner/memory.py). Moved out of `planner.calibrate`, which
runs them and keeps their figures in the `HostProfile`.
"""

from __future__ import annotations

import itertools
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator

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
    TrainConfig,
)
from polytrain.core.optim import lr_at
from polytrain.core.strategy import Strategy
from polytrain.data.datasets import build_datasets
from polytrain.data.sampler import Batches
from polytrain.errors import PlanError
from polytrain.models.registry import block_size_of, build_model
from polytrain.observe.metrics import peak_memory_mb
from polytrain.parallel.family import build_spmd
from polytrain.planner.kernels import OpCounter
from polytrain.planner.timing import Rounds

__all__ = ["WORKER_IMPORTS", "fresh_worker_memory", "rank_baseline", "rank_loop_overhead"]


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


WORKER_IMPORTS = (
    "import torch, polytrain.trainer.worker, polytrain.parallel, polytrain.pipeline, "
    "polytrain.ps, polytrain.gossip.strategy, polytrain.gossip.localsgd; "
    "from polytrain.observe.metrics import peak_memory_mb; "
    "print(peak_memory_mb(torch.device('cpu')))"
)


# [Note: a worker's own memory] in planner/memory.py: after the imports (their peak printed by
# WORKER_IMPORTS), one optimizer (whose first construction imports torch._dynamo) and two steps
# of a miniature of the default model (gpt: embedding, layer norm, attention, GELU,
# cross-entropy), then the peak again and the seconds spent after the imports
_WORKER_STEP = (
    WORKER_IMPORTS + "; import time; t0 = time.perf_counter()"
    "; from polytrain.config.job import ModelConfig, OptimConfig"
    "; from polytrain.core.optim import build_optimizer"
    "; from polytrain.data.datasets import DataSpec"
    "; from polytrain.models.registry import build_model"
    "; torch.set_num_threads(1)"
    "; spec = DataSpec(kind='tokens', vocab_size=16, input_shape=(8,))"
    "; model = build_model(ModelConfig(n_layer=1, n_embd=16, n_head=2, block_size=8), spec, 0)"
    "; opt = build_optimizer(model.parameters(), OptimConfig())"
    "; x = torch.zeros(2, 8, dtype=torch.long)"
    "\nfor _ in range(2): model.loss(model(x), x).backward(); opt.step(); opt.zero_grad()"
    "\nprint(peak_memory_mb(torch.device('cpu')))"
    "\nprint(time.perf_counter() - t0)"
)


def fresh_worker_memory() -> tuple[float, float, float]:
    """(baseline bytes, runtime bytes, seconds past the imports) of one fresh interpreter.

    Baseline: the peak resident bytes once it imported what a training worker imports
    (`polytrain.trainer.worker` and the strategy packages). Workers are fresh processes
    (``python -m polytrain.trainer.worker``, spawned by the launcher), so their baseline holds
    every page of torch and polytrain; a harness rank forked from a warm parent reports less
    (the parent's pages it never touches are not its own). Runtime: what it then adds by
    building an optimizer and running a step of a negligible model ([Note: a worker's own
    memory] in planner/memory.py), which every worker holds whatever its model. The seconds
    after the imports let the caller keep that work out of a start-up time."""
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER_STEP], capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        raise PlanError(f"measuring a worker's memory failed: {proc.stderr.strip()[-300:]}")
    before, after, seconds = (float(v) for v in proc.stdout.strip().splitlines()[-3:])
    return before * 2**20, max(after - before, 0.0) * 2**20, seconds


def rank_baseline(rank: int, world: int) -> float:
    """Peak resident bytes of a worker that imported the strategy packages and joined the group (the
    trainer's own measure, `observe.metrics.peak_memory_mb`: see its [Note: inherited maxrss])."""
    return peak_memory_mb(torch.device("cpu")) * 2**20

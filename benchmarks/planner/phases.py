"""Where an SPMD step's time goes, phase by phase, for the planner's DTensor terms.

The real `SPMDStrategy` of the default job (gpt tiny, or ``--model mlp``) under each named layout, built by
`parallel.family.build_spmd` on gloo ranks (`testing.run_distributed`, one thread each), runs
3 warm-up steps and then ``--steps`` steps timed phase by phase as `core.step.finish_step` runs
them: forward, backward, the non-finite check, the loss and flag reduction, the clip (by
`parallel.grad_norm`), the optimizer step. Prints rank 0's median of each (ms) and under
"means" their means (what the trainer's step time is), one JSON line per layout.
``--profile`` adds one `torch.profiler` step's operator table on rank 0.

    PYTHONPATH=src:. python benchmarks/planner/phases.py --layouts dp2,zero2,zero3,tp2,dp2-tp2

What it showed: docs/planner.md "Ranks' skew", "The end of a step, dispatch and the loop".
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from polytrain.comm.collectives import barrier
from polytrain.comm.init import init_distributed
from polytrain.config.io import job_from_fields
from polytrain.core.step import clip_gradients_, nonfinite_flag
from polytrain.data.datasets import build_datasets
from polytrain.data.sampler import Batches
from polytrain.models.registry import block_size_of, build_model
from polytrain.parallel.family import build_spmd
from polytrain.parallel.grad_norm import grad_norm
from polytrain.parallel.spmd import SPMDStrategy
from polytrain.testing.harness import run_distributed

LAYOUTS: dict[str, dict[str, int]] = {
    "dp1": {"parallel.dp": 1},
    "dp2": {"parallel.dp": 2},
    "zero2": {"parallel.dp": 2, "parallel.zero": 2},
    "zero3": {"parallel.dp": 2, "parallel.zero": 3},
    "tp2": {"parallel.tp": 2},
    "dp2-tp2": {"parallel.dp": 2, "parallel.tp": 2},
}
PHASES = ("forward", "backward", "check", "reduce", "clip", "optimizer", "step")


def _rank(
    rank: int, world: int, model: str, name: str, steps: int, profile: bool
) -> dict[str, Any]:
    ctx = init_distributed()
    job = job_from_fields({**LAYOUTS[name], "model.name": model, "launch.nproc": world})
    torch.manual_seed(0)
    train_set, val_set, spec = build_datasets(job.data, block_size_of(job.model))
    batches = Batches(train_set, val_set, job.train.global_batch_size, job.train.seed)
    model = build_model(job.model, spec, job.train.seed)
    strategy = build_spmd(job, ctx, model, batches)
    assert isinstance(strategy, SPMDStrategy)
    params = list(strategy.model.parameters())
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}

    def step(n: int, record: bool) -> None:
        t0 = time.perf_counter()
        strategy.model.train()
        strategy.optimizer.zero_grad(set_to_none=True)
        x, y = strategy._batch(lambda r, replicas: batches.train(n, r, replicas))
        t1 = time.perf_counter()
        loss = strategy.base.loss(strategy.model(x), y)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        flag = nonfinite_flag(params, ctx.device)
        t4 = time.perf_counter()
        strategy.reduce(torch.stack([loss.detach(), flag]))
        t5 = time.perf_counter()
        clip_gradients_(params, job.optim.grad_clip, grad_norm)
        t6 = time.perf_counter()
        strategy.optimizer.step()
        t7 = time.perf_counter()
        if record:
            spans = (t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6, t7 - t0)
            for phase, secs in zip(PHASES, spans, strict=True):
                times[phase].append(secs * 1e3)

    for n in range(3):
        step(n, False)
    barrier()
    for n in range(3, 3 + steps):
        step(n, True)
    out: dict[str, Any] = {phase: round(statistics.median(v), 2) for phase, v in times.items()}
    # the trainer times a step's mean: a phase whose mean is well above its median waits now
    # and then (docs/planner.md "Ranks' skew": waiting per synchronization)
    out["means"] = {phase: round(statistics.mean(v), 2) for phase, v in times.items()}
    out["tensors"] = len(params)
    out["dtensors"] = sum(isinstance(p, DTensor) for p in params)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        with profiler(activities=[ProfilerActivity.CPU]) as prof:
            step(100, False)
        if rank == 0:
            out["table"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"of {', '.join(LAYOUTS)}")
    ap.add_argument("--model", default="gpt", help="model.name of the default job (gpt, mlp)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="one profiled step's operator table")
    args = ap.parse_args()
    names = args.layouts.split(",")
    bad = [n for n in names if n not in LAYOUTS]
    if bad:
        raise SystemExit(f"--layouts: unknown {bad}; known: {', '.join(LAYOUTS)}")
    run: Callable[..., list[dict[str, Any]]] = run_distributed
    for name in names:
        world = {"dp1": 1, "dp2-tp2": 4}.get(name, 2)
        first = run(_rank, world, args.model, name, args.steps, args.profile, timeout_s=600.0)[0]
        table = first.pop("table", None)
        print(name, json.dumps(first), flush=True)
        if table:
            print(table)


if __name__ == "__main__":
    main()

"""Pipeline runtime: polytrain's GPipe/1F1B/PipeDream against torch.distributed.pipelining.

Questions, all on the same model, stages, micro-batches and processes:

1. Throughput of polytrain's interpreter against ``torch.distributed.pipelining``'s
   ``ScheduleGPipe`` and ``Schedule1F1B`` driving the very same stage modules (target >= 1.0).
2. Measured bubble (idle fraction of ranks x step time, from polytrain's trace spans) against
   the ideal ``(p - 1) / (m + p - 1)``.
3. PipeDream (asynchronous 1F1B with weight stashing) throughput against 1F1B: does the stream
   without flushes recover the bubble?
4. Stage 0's peak activation memory under 1F1B against GPipe (bytes autograd holds for the
   micro-batches in flight, counted by the runtime), against the schedule's ``min(p, m) / m``.
5. PipeDream's validation loss against 1F1B's after the default job's samples (target: within 5%).

The partition part (auto vs uniform vs brute force) is a separate script, ``partition.py``.

Run: python benchmarks/pipeline/main.py [--world 2] [--microbatches 8] [--steps 12] [--reps 6]
     [--convergence-steps 300] [--model gpt|mlp]

Throughput is reported two ways: from the median step time (all timed steps), and from the best
repetition (each repetition times ``--steps`` consecutive steps; the repetitions of all five
runners are interleaved). On a shared machine other processes steal cores at random; the best
repetition is the least disturbed one (timeit's rule), the median the typical one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent


def _job(world: int, schedule: str, m: int, steps: int, model_name: str, **extra: Any) -> Any:
    from polytrain.config import job_from_dict

    data: dict[str, Any] = {
        "model": {"name": model_name, "size": "tiny"},
        "train": {"steps": steps, "global_batch_size": 32, "eval_every": 0, "sample_tokens": 0},
        "optim": {"grad_clip": 0.0},  # torch's schedules do not clip; neither do we here
        "parallel": {"pp": world},
        "pipeline": {"schedule": schedule, "microbatches": m},
        "observe": {"progress": False, "trace": "enabled"},  # spans in memory, never written
        "launch": {"nproc": world},
    }
    for section, values in extra.items():
        data.setdefault(section, {}).update(values)
    return job_from_dict(data)


class TorchPipeline(NamedTuple):
    """Torch's side of one schedule on this rank."""

    step: Callable[[int], float]
    """One training step (``step(t)`` trains on batch ``t``), returning the loss."""
    schedule: Any
    """The ``torch.distributed.pipelining`` schedule object."""
    stages: list[Any]
    """This rank's ``PipelineStage``s."""


def torch_stepper(
    cls: Any,
    model: Any,
    ranges: list[tuple[int, int]],
    stage_indices: tuple[int, ...],
    batches: Any,
    m: int,
    optim: Any,
    device: Any,
) -> TorchPipeline:
    """One training step of ``model``'s stages ``stage_indices`` (blocks ``ranges[s]``, the very
    `StageModule`s polytrain runs) driven by ``torch.distributed.pipelining``'s schedule ``cls``.

    Single-stage schedules (GPipe, 1F1B) get one ``PipelineStage``, the others the list of this
    rank's stages; torch places them itself (stage ``s`` on ``s % p``, or in a V for ZBV), which
    must agree with ``stage_indices``.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    from polytrain.core.optim import build_optimizer
    from polytrain.pipeline.stage import build_stage

    num_stages = len(ranges)
    x, _ = batches.train(0, 0, 1, 0, m)  # one micro-batch, for the boundary shapes
    edges = [x]  # edges[s]: stage s's input; edges[-1]: the model's output
    with torch.no_grad():
        for start, stop in ranges:
            h = edges[-1]
            for i in range(start, stop):
                h = model.blocks[i](h)
            edges.append(h)
    group = dist.new_group(list(range(dist.get_world_size())))
    pipes, modules = [], []
    for s in stage_indices:
        module = build_stage(model, *ranges[s])
        # Torch reads requires_grad off the examples to decide which gradients travel.
        example_in = edges[s].clone().requires_grad_(edges[s].is_floating_point())
        example_out = edges[s + 1].clone().requires_grad_(True)
        pipes.append(
            PipelineStage(
                module,
                s,
                num_stages,
                device,
                input_args=(example_in,),
                output_args=(example_out,),
                group=group,
            )
        )
        modules.append(module)
    single = issubclass(cls, PipelineScheduleSingle)
    schedule = cls(pipes[0] if single else pipes, n_microbatches=m, loss_fn=model.loss)
    optimizer = build_optimizer([p for mod in modules for p in mod.parameters()], optim)
    first, last = 0 in stage_indices, num_stages - 1 in stage_indices

    def step(t: int) -> float:
        optimizer.zero_grad(set_to_none=True)
        xb, yb = batches.train(t, 0, 1)
        losses: list[torch.Tensor] = []
        schedule.step(
            *((xb,) if first else ()),
            **({"target": yb, "losses": losses} if last else {}),
        )
        optimizer.step()
        loss = torch.stack(losses).sum() / m if losses else torch.zeros(())
        dist.all_reduce(loss)  # as polytrain reports the loss to every rank
        return float(loss.detach())

    return TorchPipeline(step, schedule, pipes)


def time_interleaved(
    steppers: dict[str, Callable[[int], Any]], reps: int, steps: int, *, alternate: bool = False
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, float]]:
    """Samples/s of each repetition, every timed step's seconds and the last step's loss, per
    runner (every runner trains its own model on the same batches, so the losses agree).

    Repetition 0 warms up; the runners take turns each repetition, so drift in the machine's
    load hits all alike (``alternate``: in reverse order every other repetition, so no runner
    always follows the same one). Each runner's repetition runs ``steps`` consecutive steps
    between barriers. Each of our steps is read as the training loop reads it: a step's deferred
    result once the next step has started ([Note: deferred step results], PipeDream only).
    """
    import torch.distributed as dist

    from polytrain.core.strategy import StepOutput, step_result

    samples: dict[str, list[float]] = {name: [] for name in steppers}
    step_times: dict[str, list[float]] = {name: [] for name in steppers}
    last_loss: dict[str, float] = {}
    for rep in range(reps + 1):
        order = list(steppers.items())
        for name, fn in reversed(order) if alternate and rep % 2 else order:
            dist.barrier()
            t0 = time.perf_counter()
            previous = None
            for t in range(rep * steps, (rep + 1) * steps):
                s0 = time.perf_counter()
                out = fn(t)
                if previous is not None:
                    step_result(previous)
                previous = out if isinstance(out, StepOutput) else None
                if rep:
                    step_times[name].append(time.perf_counter() - s0)
            if previous is not None:
                out = step_result(previous)
            dist.barrier()
            if rep:
                samples[name].append(steps * 32 / (time.perf_counter() - t0))
            last_loss[name] = float(out.loss if isinstance(out, StepOutput) else out)
    return samples, step_times, last_loss


def _rank(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from polytrain.comm.init import init_distributed
    from polytrain.comm.mesh import build_mesh
    from polytrain.data import Batches, build_datasets
    from polytrain.models.registry import block_size_of, build_model
    from polytrain.pipeline.family import pipeline_strategy
    from polytrain.pipeline.strategy import PipelineStrategy
    from polytrain.topology import ParallelDims
    from polytrain.trainer.loop import train

    m, steps, reps = args["microbatches"], args["steps"], args["reps"]
    ctx = init_distributed()
    total_steps = (reps + 1) * steps
    base = _job(world, "1f1b", m, total_steps, args["model"])
    train_set, val_set, spec = build_datasets(base.data, block_size_of(base.model))
    batches = Batches(train_set, val_set, base.train.global_batch_size, base.train.seed)
    dims = ParallelDims(pp=world)

    def ours(schedule: str, track: bool = False) -> PipelineStrategy:
        job = _job(world, schedule, m, total_steps, args["model"])
        model = build_model(job.model, spec, job.train.seed)
        strategy = pipeline_strategy(job, model, build_mesh(dims), batches, ctx.device)
        strategy.runtime.track_activations = track
        return strategy

    strategies: dict[str, Any] = {name: ours(name) for name in ("gpipe", "1f1b", "pipedream")}
    ranges = strategies["1f1b"].ranges

    def torch_schedule(cls: Any) -> Any:
        model = build_model(base.model, spec, base.train.seed)
        return torch_stepper(cls, model, ranges, (rank,), batches, m, base.optim, ctx.device).step

    steppers: dict[str, Any] = {
        "ours_gpipe": strategies["gpipe"].train_step,
        "ours_1f1b": strategies["1f1b"].train_step,
        "ours_pipedream": strategies["pipedream"].train_step,
        "torch_gpipe": torch_schedule(ScheduleGPipe),
        "torch_1f1b": torch_schedule(Schedule1F1B),
    }
    samples, step_times, _ = time_interleaved(steppers, reps, steps)

    # Stage 0's live activation bytes under each schedule (two steps, counting on).
    memory = {}
    for schedule in ("gpipe", "1f1b"):
        tracked = ours(schedule, track=True)
        for t in range(2):
            tracked.train_step(t)
        memory[schedule] = tracked.runtime.stats.peak_activation_bytes

    events = {name: strategies[name].tracer.events for name in ("gpipe", "1f1b", "pipedream")}
    out: dict[str, Any] = {
        "samples_per_s": {k: statistics.median(v) for k, v in samples.items()},
        "best_rep_samples_per_s": {k: max(v) for k, v in samples.items()},
        "step_s": {k: statistics.median(v) for k, v in step_times.items()},
        "peak_activation_bytes": memory,
        "events": events,
        "ranges": ranges,
    }

    # PipeDream against 1F1B on the default job (gpt tiny, 300 steps, AdamW, cosine).
    if args["convergence_steps"]:
        for schedule in ("1f1b", "pipedream"):
            job = _job(
                world,
                schedule,
                m,
                args["convergence_steps"],
                args["model"],
                optim={"grad_clip": 1.0},
                observe={"trace": ""},
            )
            result = train(job, ctx=ctx)
            out[f"val_loss_{schedule}"] = result.val_loss
            out[f"final_loss_{schedule}"] = result.final_loss
    return out


def _bubbles(events: list[list[dict[str, Any]]], skip_first: int) -> float:
    """Median over steps of the measured bubble, all ranks' spans merged."""
    from polytrain.observe.timeline import measured_bubble

    merged = [e for rank_events in events for e in rank_events if "stage" in e["args"]]
    steps = sorted({e["args"]["step"] for e in merged})[skip_first:]
    return statistics.median(
        measured_bubble([e for e in merged if e["args"]["step"] == s]) for s in steps
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="pipeline stages (= processes)")
    parser.add_argument("--microbatches", type=int, default=8)
    # Repetitions long enough that PipeDream's stream, which a barrier between repetitions
    # drains, spends most steps in its steady state (with the same code, 6-step repetitions
    # measured PipeDream / 1F1B at 1.01-1.02x and 12-step ones at 1.05x).
    parser.add_argument("--steps", type=int, default=12, help="steps per timed repetition")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--convergence-steps", type=int, default=300)
    parser.add_argument(
        "--model",
        choices=("gpt", "mlp"),
        default="gpt",
        help="tiny size; mlp: ms-scale steps, where the messages' latency decides "
        "(writes results_mlp.json)",
    )
    args = parser.parse_args()

    from polytrain.pipeline.schedule import bubble_fraction
    from polytrain.testing import run_distributed

    p, m = args.world, args.microbatches
    results = run_distributed(_rank, p, vars(args), timeout_s=1800, collective_timeout_s=600)
    r0 = results[0]
    # Throughput from the median step time: robust to another process stealing a core for a
    # few steps on a shared machine (the per-repetition medians are reported too).
    sps = {k: 32 / v for k, v in r0["step_s"].items()}
    best = r0["best_rep_samples_per_s"]
    events = {k: [r["events"][k] for r in results] for k in r0["events"]}
    last = results[-1]  # the last stage holds the loss; every rank reports the same value
    out: dict[str, Any] = {
        "stages": p,
        "microbatches": m,
        "model": f"{args.model}-tiny, global batch 32, AdamW, gloo, 1 thread per rank",
        "partition": r0["ranges"],
        "cpu_count": os.cpu_count(),
        "throughput_ratio_vs_torch_gpipe": sps["ours_gpipe"] / sps["torch_gpipe"],
        "throughput_ratio_vs_torch_1f1b": sps["ours_1f1b"] / sps["torch_1f1b"],
        "pipedream_vs_1f1b_throughput": sps["ours_pipedream"] / sps["ours_1f1b"],
        "best_rep_ratio_vs_torch_gpipe": best["ours_gpipe"] / best["torch_gpipe"],
        "best_rep_ratio_vs_torch_1f1b": best["ours_1f1b"] / best["torch_1f1b"],
        "best_rep_pipedream_vs_1f1b": best["ours_pipedream"] / best["ours_1f1b"],
        "bubble_ideal": bubble_fraction(p, m),
        "bubble_measured_gpipe": _bubbles(events["gpipe"], args.steps),
        "bubble_measured_1f1b": _bubbles(events["1f1b"], args.steps),
        "bubble_measured_pipedream": _bubbles(events["pipedream"], args.steps),
        "stage0_peak_activation_bytes": r0["peak_activation_bytes"],
        "stage0_activation_ratio_1f1b_vs_gpipe": r0["peak_activation_bytes"]["1f1b"]
        / r0["peak_activation_bytes"]["gpipe"],
        "stage0_activation_ratio_expected": min(p, m) / m,
        "samples_per_s": sps,
        "samples_per_s_median_of_repetitions": r0["samples_per_s"],
        "samples_per_s_best_repetition": best,
        "median_step_s": r0["step_s"],
    }
    if args.convergence_steps:
        v1, vp = last["val_loss_1f1b"], last["val_loss_pipedream"]
        out |= {
            "convergence_steps": args.convergence_steps,
            "val_loss_1f1b": v1,
            "val_loss_pipedream": vp,
            "pipedream_val_loss_rel_diff": (vp - v1) / v1,
        }
    text = json.dumps(out, indent=2)
    print(text)
    name = "results.json" if args.model == "gpt" else f"results_{args.model}.json"
    (HERE / name).write_text(text + "\n")


if __name__ == "__main__":
    main()

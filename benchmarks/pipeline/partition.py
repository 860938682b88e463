"""Automatic pipeline partitioning against uniform and against the brute-force best partition.

Question: on a deliberately unbalanced model, is ``pipeline.partition = auto`` (profile every
block, then PipeDream's min-max dynamic program) faster than ``uniform``, and within 10% of the
best contiguous partition found by trying them all?

Two measurements on the same model, micro-batch and schedule:

1. **Real pipeline** (``--stages 2``, one process per stage, gloo): the whole job runs through
   polytrain's pipeline runtime (1f1b) for every contiguous 2-stage partition, plus ``auto``
   and ``uniform`` as the user would run them, and ``auto`` with ``partition_trials = 0`` (the
   profile's choice alone, "auto-profile"); the step time is the best after warm-up.
2. **Stage proxy** (``--proxy-stages 2 3 4``, one process): every contiguous block range is
   timed forward + backward on one micro-batch; a partition's measured time is its slowest
   stage (the steady-state period of a pipeline) and ``sum + (m - 1) x max`` for a step. This
   reaches more stages than the cores here can run side by side.

Run: python benchmarks/pipeline/partition.py [--steps 10] [--rounds 3] [--stages 2] [--proxy-stages 2 3 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]  # the factory is imported by name, by this process and its workers

# Hidden width of each residual-free MLP block, in units of WIDTH: two heavy blocks up front,
# so 'uniform' puts almost all the work on stage 0.
HIDDEN_UNITS = (1, 4, 4) + (1,) * 13
WIDTH = 384
EMBED, CONTEXT = 24, 16  # tokens (B, 16) -> (B, 16 * 24 = 384)
MICROBATCHES = 4
ROWS = 64  # per micro-batch


def build_unbalanced(spec: Any) -> Any:
    """Model factory (``model.name = "benchmarks.pipeline.partition:build_unbalanced"``)."""
    import torch.nn.functional as F
    from torch import nn

    from polytrain.models.base import BlockModel
    from polytrain.models.mlp import next_token_loss

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(spec.vocab_size, EMBED)

        def forward(self, idx: Any) -> Any:
            return self.tok(idx).flatten(1)  # (B, T*E)

    class Wide(nn.Module):
        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.fc = nn.Linear(WIDTH, hidden)
            self.proj = nn.Linear(hidden, WIDTH)

        def forward(self, x: Any) -> Any:
            return self.proj(F.gelu(self.fc(x)))  # (B, WIDTH) -> (B, WIDTH)

    blocks: list[nn.Module] = [Embed()]
    blocks += [Wide(units * WIDTH) for units in HIDDEN_UNITS]
    blocks.append(nn.Linear(WIDTH, spec.vocab_size))
    return BlockModel(blocks, next_token_loss)


def _job(partition: str | list[int], stages: int, steps: int) -> Any:
    """``partition = "auto-profile"``: ``auto`` without trials (the profile's choice alone)."""
    from polytrain.config import job_from_dict

    trials = 0 if partition == "auto-profile" else 4  # 4: the default of partition_trials
    if partition == "auto-profile":
        partition = "auto"

    return job_from_dict(
        {
            "model": {
                "name": "benchmarks.pipeline.partition:build_unbalanced",
                "block_size": CONTEXT,
            },
            "train": {
                "steps": steps,
                "global_batch_size": ROWS * MICROBATCHES,
                "eval_every": 0,
                "eval_batches": 1,
                "sample_tokens": 0,
            },
            "optim": {"name": "sgd", "lr": 0.01, "schedule": "constant", "warmup_steps": 0},
            "parallel": {"pp": stages},
            "pipeline": {
                "schedule": "1f1b",
                "microbatches": MICROBATCHES,
                "partition": partition,
                "partition_trials": trials,
            },
            "observe": {"progress": False},
            "launch": {"nproc": stages},
        }
    )


def _pipeline_rank(
    rank: int, world: int, jobs: dict[str, Any], rounds: int, warmup: int
) -> dict[str, Any]:
    """Train every job ``rounds`` times, interleaved; per job the step-time medians and counts."""
    import polytrain.pipeline.strategy as pipeline_strategy
    from polytrain.trainer.loop import train

    chosen: list[list[int]] = []
    choose = pipeline_strategy.choose_partition

    def recording(*args: Any, **kwargs: Any) -> list[int]:  # which counts the run really used
        counts = choose(*args, **kwargs)
        chosen.append(counts)
        return counts

    pipeline_strategy.choose_partition = recording  # type: ignore[assignment]
    out: dict[str, Any] = {key: {"step_s": [], "counts": []} for key in jobs}
    for _ in range(rounds):
        for key, job in jobs.items():
            result = train(job)
            out[key]["step_s"].append([r["step_time_s"] for r in result.history][warmup:])
            out[key]["counts"].append(chosen[-1])
    return out


def measure_pipeline(
    partitions: dict[str, str | list[int]], stages: int, steps: int, warmup: int, rounds: int
) -> dict[str, Any]:
    """Per partition and round: the slowest rank's time per step; then the median step and the
    best step, each the lowest over ``rounds``, and the counts each round used.

    On a machine shared with other work, preemption only ever adds time, so the best step is the
    steadier estimate of what the partition costs; the medians are kept for reference.
    """
    from polytrain.testing import run_distributed

    jobs = {key: _job(partition, stages, steps) for key, partition in partitions.items()}
    per_rank = run_distributed(_pipeline_rank, stages, jobs, rounds, warmup, timeout_s=900)
    out: dict[str, Any] = {}
    for key in jobs:
        steps_per_round = [
            [max(times) for times in zip(*(r[key]["step_s"][i] for r in per_rank), strict=True)]
            for i in range(rounds)
        ]
        medians = [statistics.median(steps) for steps in steps_per_round]
        out[key] = {
            "step_s": min(min(steps) for steps in steps_per_round),
            "median_step_s": min(medians),
            "round_medians_s": medians,
            "counts": per_rank[0][key]["counts"],
        }
    return out


def _sample(model: Any) -> tuple[Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    vocab = model.blocks[-1].out_features
    x = torch.randint(0, vocab, (ROWS, CONTEXT), generator=gen)
    return x, torch.randint(0, vocab, (ROWS, CONTEXT), generator=gen)


def measure_ranges(
    model: Any, sample: tuple[Any, Any], repeats: int
) -> dict[tuple[int, int], float]:
    """Median forward + backward CPU time of every contiguous range ``[a, b)`` on one micro-batch.

    Timed in rounds over all ranges, so a change in the machine's load hits every range alike;
    CPU time (one thread) leaves out what other processes on a shared machine take.
    """
    import torch

    n = model.num_blocks
    inputs = [sample[0]]
    with torch.no_grad():
        for block in model.blocks:
            inputs.append(block(inputs[-1]))
    ranges = [(a, b) for a in range(n) for b in range(a + 1, n + 1)]
    runs: dict[tuple[int, int], list[float]] = {r: [] for r in ranges}
    for round_index in range(repeats + 1):
        for a, b in ranges:
            x = inputs[a].detach()
            if x.is_floating_point():
                x.requires_grad_(True)
            stage = model.blocks[a:b]
            wrt = ([x] if x.requires_grad else []) + list(stage.parameters())
            t0 = time.process_time()
            out = stage(x)
            if b == n:
                out = model.loss(out, sample[1])
            torch.autograd.grad(out, wrt, grad_outputs=torch.ones_like(out))
            if round_index:
                runs[(a, b)].append(time.process_time() - t0)
    return {r: statistics.median(t) for r, t in runs.items()}


def _measured(times: dict[tuple[int, int], float], counts: list[int]) -> dict[str, float]:
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    stage = [times[(bounds[s], bounds[s + 1])] for s in range(len(counts))]
    return {"bottleneck_s": max(stage), "step_s": sum(stage) + (MICROBATCHES - 1) * max(stage)}


def proxy(
    stages: int, model: Any, profiles: Any, times: dict[tuple[int, int], float]
) -> dict[str, Any]:
    from polytrain.pipeline.partition import (
        all_partitions,
        evaluate_partition,
        search_partition,
        uniform_counts,
    )

    kw: dict[str, Any] = {"schedule": "1f1b", "num_microbatches": MICROBATCHES}
    n = model.num_blocks
    auto = search_partition(profiles, stages, memory_limit_bytes=None, **kw)
    uniform = uniform_counts(n, stages)
    every = list(all_partitions(n, stages))
    measured = {tuple(c): _measured(times, c) for c in every}
    # The best by the quantity the ratios compare (the step), not by the bottleneck alone.
    best = min(every, key=lambda c: measured[tuple(c)]["step_s"])
    predicted_best = min(every, key=lambda c: evaluate_partition(profiles, c, **kw).bottleneck_s)

    def row(counts: list[int]) -> dict[str, Any]:
        predicted = evaluate_partition(profiles, counts, **kw)
        return {
            "counts": counts,
            "predicted_step_s": predicted.predicted_step_s,
            "measured_step_s": measured[tuple(counts)]["step_s"],
        }

    result = {
        "stages": stages,
        "partitions_tried": len(every),
        "auto": row(auto.counts),
        "uniform": row(uniform),
        "best_measured": row(best),
        "best_predicted_by_brute_force": predicted_best,
    }
    a = result["auto"]["measured_step_s"]
    result["uniform_over_auto"] = result["uniform"]["measured_step_s"] / a
    result["auto_over_best"] = a / result["best_measured"]["measured_step_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per real pipeline run")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out")
    parser.add_argument("--stages", type=int, default=2, help="real pipeline stages (0 = skip)")
    parser.add_argument("--proxy-stages", type=int, nargs="*", default=[2, 3, 4])
    parser.add_argument("--rounds", type=int, default=3, help="real runs per partition (best)")
    parser.add_argument("--repeats", type=int, default=7, help="proxy timing repeats")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
    )

    import torch

    from polytrain.core.optim import build_optimizer
    from polytrain.data.datasets import build_datasets
    from polytrain.models.registry import build_model
    from polytrain.pipeline.partition import (
        all_partitions,
        evaluate_partition,
        search_partition,
    )
    from polytrain.pipeline.profile import profile_blocks

    torch.set_num_threads(1)  # as each pipeline rank runs
    job = _job("auto", 2, args.steps)
    _, _, spec = build_datasets(job.data, CONTEXT)
    model = build_model(job.model, spec, job.train.seed)
    sample = _sample(model)
    profiles = profile_blocks(  # as `auto` does inside the runs: the job's optimizer (SGD)
        model,
        sample,
        warmup=2,
        repeats=args.repeats,
        optimizer_factor=0,
        optimizer=partial(build_optimizer, cfg=job.optim),
    )
    report: dict[str, Any] = {
        "model": f"embed + Wide(hidden = {list(HIDDEN_UNITS)} x {WIDTH}) + head",
        "blocks": model.num_blocks,
        "schedule": "1f1b",
        "microbatches": MICROBATCHES,
        "rows_per_microbatch": ROWS,
        "cpu_count": os.cpu_count(),
        "load_average_at_start": os.getloadavg()[0],
        "torch": torch.__version__,
        "block_time_ms": [round((p.forward_s + p.backward_s) * 1e3, 3) for p in profiles],
    }
    times = measure_ranges(model, sample, args.repeats)
    report["proxy"] = [proxy(p, model, profiles, times) for p in args.proxy_stages]
    for p in args.proxy_stages:
        print(
            search_partition(
                profiles, p, schedule="1f1b", num_microbatches=MICROBATCHES, memory_limit_bytes=None
            ).table()
        )

    if args.stages:
        kw: dict[str, Any] = {"schedule": "1f1b", "num_microbatches": MICROBATCHES}
        every = list(all_partitions(model.num_blocks, args.stages))
        partitions: dict[str, str | list[int]] = {str(c): c for c in every}
        partitions |= {"uniform": "uniform", "auto": "auto", "auto-profile": "auto-profile"}
        measured = measure_pipeline(partitions, args.stages, args.steps, args.warmup, args.rounds)
        for key, value in measured.items():
            if key not in ("uniform", "auto", "auto-profile"):
                counts = partitions[key]
                assert isinstance(counts, list)
                value["predicted_step_s"] = evaluate_partition(
                    profiles, counts, **kw
                ).predicted_step_s
            print(
                f"{key}: best step {value['step_s'] * 1e3:.1f} ms, median "
                f"{value['median_step_s'] * 1e3:.1f} ms, counts {value['counts']}",
                flush=True,
            )
        best = min(every, key=lambda c: measured[str(c)]["step_s"])
        auto_s = measured["auto"]["step_s"]
        report["pipeline"] = {
            "stages": args.stages,
            "steps": args.steps,
            "rounds": args.rounds,
            "auto": measured["auto"],
            "auto_profile_only": measured["auto-profile"],
            "uniform": measured["uniform"],
            "best_measured": {"counts": best, **measured[str(best)]},
            "auto_predicted_here": search_partition(
                profiles, args.stages, memory_limit_bytes=None, **kw
            ).counts,
            "every_partition": {str(c): measured[str(c)] for c in every},
            "uniform_over_auto": measured["uniform"]["step_s"] / auto_s,
            "auto_over_best": auto_s / measured[str(best)]["step_s"],
            "median_uniform_over_auto": measured["uniform"]["median_step_s"]
            / measured["auto"]["median_step_s"],
            "median_auto_over_best": measured["auto"]["median_step_s"]
            / min(measured[str(c)]["median_step_s"] for c in every),
            "profile_only_over_best": measured["auto-profile"]["step_s"]
            / measured[str(best)]["step_s"],
            # The partition each run chose, timed in the same sweep as every other partition:
            # compares partitions without the step-time spread between job instances.
            "auto_choice_over_best": max(
                measured[str(c)]["step_s"] for c in measured["auto"]["counts"]
            )
            / measured[str(best)]["step_s"],
            "profile_only_choice_over_best": max(
                measured[str(c)]["step_s"] for c in measured["auto-profile"]["counts"]
            )
            / measured[str(best)]["step_s"],
        }

    report["load_average_at_end"] = os.getloadavg()[0]
    text = json.dumps(report, indent=2)
    print(text)
    (HERE / "results_partition.json").write_text(text + "\n")


if __name__ == "__main__":
    main()

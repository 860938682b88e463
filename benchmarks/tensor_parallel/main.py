"""Tensor parallel against data parallel on the same model: step time and per-rank memory.

Question: splitting every transformer block over ``tp`` ranks (Megatron) instead of replicating
it over ``dp`` ranks, what does a step cost in time, and how much model state (parameters,
gradients, AdamW moments) and peak resident memory does each rank hold? Both layouts train the
same job (same global batch, same weights) through polytrain's own strategies; each layout runs
in fresh processes (so peak RSS is its own), alternating dp, tp, dp, tp.

Run: python benchmarks/tensor_parallel/main.py [--world 2] [--steps 8] [--reps 2]
     [--n-layer 4] [--n-embd 512] [--n-head 8] [--block-size 64] [--batch 16]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _job(layout: str, world: int, args: dict[str, Any]) -> Any:
    from polytrain.config import job_from_dict

    return job_from_dict(
        {
            "model": {
                "name": "gpt",
                "n_layer": args["n_layer"],
                "n_embd": args["n_embd"],
                "n_head": args["n_head"],
                "block_size": args["block_size"],
            },
            "train": {
                "global_batch_size": args["batch"],
                "eval_every": 0,
                "sample_tokens": 0,
            },
            "optim": {"name": "adamw", "schedule": "constant", "warmup_steps": 0},
            "parallel": {"dp": world, "tp": 1} if layout == "dp" else {"dp": 1, "tp": world},
            "observe": {"progress": False},
            "launch": {"nproc": world},
        }
    )


def _local_bytes(t: Any) -> int:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return int(local.numel() * local.element_size())


def _rank(rank: int, world: int, layout: str, args: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from polytrain.comm.init import init_distributed
    from polytrain.data import Batches, build_datasets
    from polytrain.models.registry import block_size_of, build_model
    from polytrain.trainer.build import build_strategy

    job = _job(layout, world, args)
    ctx = init_distributed()
    train, val, spec = build_datasets(job.data, block_size_of(job.model))
    batches = Batches(train, val, job.train.global_batch_size, job.train.seed)
    strategy = build_strategy(job, ctx, build_model(job.model, spec, 0), batches)
    for step in range(2):  # warm-up; AdamW state exists after the first step
        strategy.train_step(step)
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(2, 2 + args["steps"]):
        strategy.train_step(step)
    dist.barrier()
    step_s = (time.perf_counter() - t0) / args["steps"]
    params = [p for m in strategy.modules for p in m.parameters()]
    opt = strategy.optimizer
    assert opt is not None
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {
        "step_s": step_s,
        "param_bytes": sum(_local_bytes(p) for p in params),
        "grad_bytes": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optim_bytes": sum(_local_bytes(t) for t in state if t.dim() > 0),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "strategy": strategy.name,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="global batch (samples)")
    args = vars(parser.parse_args())
    world = args.pop("world")
    reps = args.pop("reps")

    from polytrain.testing import run_distributed

    runs: dict[str, list[dict[str, Any]]] = {"dp": [], "tp": []}
    for _ in range(reps):  # alternating, so drift in machine load hits both alike
        for layout in runs:
            per_rank = run_distributed(_rank, world, layout, args, timeout_s=900)
            runs[layout].append(
                {
                    **per_rank[0],
                    "step_s": max(r["step_s"] for r in per_rank),
                    "peak_rss_mb": max(r["peak_rss_mb"] for r in per_rank),
                }
            )
    result: dict[str, Any] = {"world": world, "model": {"name": "gpt", **args}}
    for layout, reps_out in runs.items():
        last = reps_out[-1]
        result[layout] = {
            "strategy": last["strategy"],
            "step_s": statistics.median(r["step_s"] for r in reps_out),
            "model_state_mb_per_rank": (
                last["param_bytes"] + last["grad_bytes"] + last["optim_bytes"]
            )
            / 2**20,
            "param_mb": last["param_bytes"] / 2**20,
            "grad_mb": last["grad_bytes"] / 2**20,
            "optim_mb": last["optim_bytes"] / 2**20,
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in reps_out),
        }
    dp, tp = result["dp"], result["tp"]
    result["tp_over_dp_step_time"] = tp["step_s"] / dp["step_s"]
    result["tp_over_dp_model_state"] = tp["model_state_mb_per_rank"] / dp["model_state_mb_per_rank"]
    result["tp_over_dp_peak_rss"] = tp["peak_rss_mb"] / dp["peak_rss_mb"]
    print(json.dumps(result, indent=2))
    (HERE / "results.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

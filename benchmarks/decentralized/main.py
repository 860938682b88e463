"""Decentralized training at loopback: bytes per worker per step and time to a target loss.

Question: against all-reduce data parallel on the same job, workers and samples, how many bytes
does each worker hand to c10d per step under gossip (ring, exponential graph, one random peer)
and local SGD (period H), and how soon does each reach a target validation loss?

Peers, all in this script on the same job (MLP tiny, SGD, 4 workers on loopback):
- ``allreduce``: polytrain data parallel (DDP);
- ``gossip-ring``, ``gossip-exponential``, ``gossip-random1``, ``gossip-random1-bf16``;
- ``localsgd-h<H>``.

Bytes: the step records' ``bytes_sent`` (the sizes of the tensors the strategy handed to c10d);
for all-reduce, the size of the gradients DDP all-reduces every step (every parameter's gradient
once, fp32), which is what DDP hands to c10d, computed from the model. Time to target = rank 0's
summed step times until its first validation (of the average model) at or below the target; the
target is the validation loss all-reduce reaches at ``--target-at`` of its run. Evaluation time
is not counted.

Not here yet: the emulated slow link (network namespaces joined by a tbf-limited veth).

Run: python benchmarks/decentralized/main.py [--steps 120] [--period 4]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORLD = 4


def _job(mode: str, args: argparse.Namespace, out_dir: str) -> Any:
    from polytrain.config import job_from_dict

    data: dict[str, Any] = {
        "model": {"name": "mlp", "size": "tiny"},
        "train": {
            "steps": args.steps,
            "global_batch_size": 64,
            "seed": 0,
            "eval_every": args.eval_every,
            "eval_batches": 4,
            "sample_tokens": 0,
        },
        "optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "schedule": "constant"},
        "observe": {"progress": False, "out_dir": out_dir, "log_every": args.eval_every},
        "launch": {"nproc": WORLD},
    }
    if mode.startswith("gossip-"):
        topology = mode.split("-")[1]
        gossip: dict[str, Any] = {"topology": "random" if topology == "random1" else topology}
        if topology == "random1":
            gossip["peers"] = 1
        if mode.endswith("-bf16"):
            gossip["compress"] = "bf16"
        data["parallel"] = {"sync": "gossip"}
        data["gossip"] = gossip
    elif mode.startswith("localsgd"):
        data["parallel"] = {"sync": "localsgd"}
        data["localsgd"] = {"period": args.period}
    return job_from_dict(data)


def _rank(
    rank: int, world: int, mode: str, args: argparse.Namespace, out_dir: str
) -> dict[str, Any]:
    from polytrain.trainer.loop import train

    result = train(_job(mode, args, out_dir))
    elapsed, curve, sent = 0.0, [], []
    for record in result.history:
        elapsed += record["step_time_s"]
        sent.append(record.get("bytes_sent", float("nan")))
        if "val_loss" in record:
            curve.append((record["step"], elapsed, record["val_loss"]))
    n_bytes = (
        sum(t.numel() * t.element_size() for t in result.state_dict.values()) if rank == 0 else 0
    )
    distances = [r["consensus_distance"] for r in result.history if "consensus_distance" in r]
    return {
        "curve": curve,
        "bytes_per_step": sum(sent) / len(sent),
        "model_bytes": n_bytes,
        "train_time_s": elapsed,
        "consensus_distance": distances,
    }


def main() -> None:
    from polytrain.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--period", type=int, default=4)
    parser.add_argument("--target-at", type=float, default=0.75, help="fraction of DP's run")
    args = parser.parse_args()

    modes = [
        "allreduce",
        "gossip-ring",
        "gossip-exponential",
        "gossip-random1",
        "gossip-random1-bf16",
        f"localsgd-h{args.period}",
    ]
    runs: dict[str, dict[str, Any]] = {}
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix=f"decentralized-{mode}-") as out_dir:
            results = run_distributed(_rank, WORLD, mode, args, out_dir, timeout_s=1800)
            runs[mode] = dict(results[0])
            print(mode, json.dumps({k: v for k, v in runs[mode].items() if k != "curve"}))

    dp = runs["allreduce"]
    target = min(
        (c for c in dp["curve"] if c[0] >= args.target_at * args.steps), key=lambda c: c[0]
    )[2]
    dp["bytes_per_step"] = dp["model_bytes"]  # DDP all-reduces every fp32 gradient once a step
    table = {}
    for mode, run in runs.items():
        reach = next((t for _, t, loss in run["curve"] if loss <= target), None)
        table[mode] = {
            "bytes_per_worker_per_step": run["bytes_per_step"],
            "bytes_vs_allreduce": run["bytes_per_step"] / dp["bytes_per_step"],
            "final_val_loss": run["curve"][-1][2],
            "val_loss_vs_allreduce": run["curve"][-1][2] / dp["curve"][-1][2],
            "time_to_target_s": reach,
            "train_time_s": run["train_time_s"],
            "max_consensus_distance": max(run["consensus_distance"], default=0.0),
        }
    base = table["allreduce"]["time_to_target_s"]
    for row in table.values():
        t = row["time_to_target_s"]
        row["speedup_vs_allreduce"] = base / t if t and base else None
    out = {"target_val_loss": target, "steps": args.steps, "world": WORLD, "table": table}
    text = json.dumps(out, indent=2)
    print(text)
    (HERE / "results.json").write_text(text + "\n")


if __name__ == "__main__":
    main()

"""Decentralized training at loopback and over an emulated slow link: bytes and time to target.

Question: against all-reduce data parallel on the same job, workers and samples, how many bytes
does each worker hand to c10d per step under gossip (topologies, compression) and local SGD,
how close does each end to data parallel's validation loss, and how soon does each reach a
target validation loss, on loopback and on 4 hosts joined by ``tbf``-limited links?

Peers, all in this script on the same job and 4 workers, one process per rank:
- ``allreduce[-topk|-sign]``: polytrain data parallel (DDP), optionally with the top-k / 1-bit
  sign gradient hook ([Note: sparse gradient hook]);
- ``gossip-<topology>[-<compress>][-overlap|-async]``: ring, torus (2 x 2), exponential, one
  random peer; compression bf16, 1-bit sign or top-k (CHOCO, [Note: CHOCO gossip]); rounds
  overlapped with the next step ([Note: overlapped gossip]) or asynchronous;
- ``localsgd-h<H>[-<compress>]``: world average every H steps, optionally compressed with
  error feedback ([Note: compressed averaging]).

Settings: ``loopback`` (the four processes on this host's loopback) and ``slow`` (each rank in
its own network namespace, every host's link limited to ``--rate`` Mbit/s in both directions
by ``tc tbf``: `polytrain.testing.cluster`, set up and torn down here; needs root). Part 2, the
default job (char GPT tiny, AdamW): validation loss of every topology and local SGD against
all-reduce after the same samples, at loopback. Part 3 (``overlap``): GPT tiny on the four
hosts at ``--overlap-rate`` Mbit/s, blocking against overlapped ring gossip: step time and the
seconds per step blocked on the exchange (``exchange_wait_s``).

Bytes: the step records' ``bytes_sent`` (sizes of the tensors handed to c10d); for all-reduce
the fp32 gradients DDP all-reduces once a step (the model's parameter bytes). Time to target =
rank 0's summed step times (evaluation excluded) until its first validation (of the average
model) at or below the target, the validation loss all-reduce reaches at ``--target-at`` of its
run in the same setting. The consensus distances of the loopback MLP runs are plotted to
``consensus.png``.

Run (root, from the worktree with PYTHONPATH=src):
    python benchmarks/decentralized/main.py [--steps 80] [--rate 20] [--gpt-steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
WORLD = 4
PORT = 29680

LOOPBACK_MODES = [
    "allreduce",
    "gossip-ring",
    "gossip-torus",
    "gossip-exponential",
    "gossip-random1",
    "gossip-ring-bf16",
    "gossip-ring-sign",
    "gossip-ring-topk",
    "localsgd-h4",
    "localsgd-h4-sign",
    "localsgd-h4-topk",
]
SLOW_MODES = [
    "allreduce",
    "allreduce-sign",
    "allreduce-topk",
    "gossip-ring",
    "gossip-ring-overlap",
    "gossip-ring-bf16",
    "gossip-ring-bf16-overlap",
    "gossip-ring-async",
    "gossip-ring-sign",
    "localsgd-h4",
    "localsgd-h8",
    "localsgd-h4-sign",
]
# Does the overlapped exchange hide behind compute where the two are of one size? GPT tiny
# (3.3 MB of fp32 parameters, a ring hands two copies a step to c10d) on a faster link.
OVERLAP_MODES = ["gossip-ring", "gossip-ring-overlap", "allreduce"]
GPT_MODES = [
    "allreduce",
    "gossip-ring",
    "gossip-torus",
    "gossip-exponential",
    "gossip-random1",
    "localsgd-h4",
]


def job_dict(mode: str, model: str, steps: int, eval_every: int) -> dict[str, Any]:
    """The job of ``mode``: the MLP benchmark job, or the default job (GPT) for ``gpt``."""
    data: dict[str, Any] = {
        "train": {"steps": steps, "eval_every": eval_every, "eval_batches": 4, "seed": 0},
        "observe": {"progress": False, "log_every": 5},
        "launch": {"nproc": WORLD},
    }
    data["train"]["sample_tokens"] = 0
    if model == "mlp":
        data["model"] = {"name": "mlp", "size": "tiny"}
        data["train"]["global_batch_size"] = 64
        data["optim"] = {"name": "sgd", "lr": 0.1, "momentum": 0.9, "schedule": "constant"}
    parts = mode.split("-")
    if parts[0] == "allreduce" and len(parts) > 1:  # DDP with a compression hook
        data["parallel"] = {"grad_compression": parts[1], "grad_topk_ratio": 0.1}
    elif parts[0] == "gossip":
        topology = "random" if parts[1] == "random1" else parts[1]
        gossip: dict[str, Any] = {"topology": topology, "peers": 1}
        for part in parts[2:]:
            if part == "overlap":  # [Note: overlapped gossip]
                gossip["overlap"] = True
            elif part == "async":
                gossip["mode"] = "async"
            else:
                gossip["compress"] = part
                gossip["topk_ratio"] = 0.1
        data["parallel"] = {"sync": "gossip"}
        data["gossip"] = gossip
    elif parts[0] == "localsgd":
        data["parallel"] = {"sync": "localsgd"}
        data["localsgd"] = {"period": int(parts[1][1:])}
        if len(parts) > 2:
            data["gossip"] = {"compress": parts[2], "topk_ratio": 0.1}
    return data


# ----------------------------------------------------------------------------- worker side
def worker(spec_path: str) -> None:
    """One rank: train the job, rank 0 writes its curve, bytes and consensus distances."""
    from polytrain.config import job_from_dict
    from polytrain.trainer.loop import train

    spec = json.loads(Path(spec_path).read_text())
    result = train(job_from_dict(spec["job"]))
    if result.state_dict is None:
        return
    elapsed, curve, sent, distance, waited = 0.0, [], [], [], []
    for record in result.history:
        elapsed += record["step_time_s"]
        sent.append(record.get("bytes_sent", float("nan")))
        if "exchange_wait_s" in record:
            waited.append(record["exchange_wait_s"])
        if "consensus_distance" in record:
            distance.append((record["step"], record["consensus_distance"]))
        if "val_loss" in record:
            curve.append((record["step"], elapsed, record["val_loss"]))
    out = {
        "strategy": result.strategy,
        "curve": curve,
        "bytes_per_step": sum(sent) / len(sent),
        "model_bytes": sum(t.numel() * t.element_size() for t in result.state_dict.values()),
        "train_time_s": elapsed,
        "consensus_distance": distance,
        "exchange_wait_s": sum(waited) / len(waited) if waited else None,
    }
    Path(spec["out"]).write_text(json.dumps(out))


# ----------------------------------------------------------------------------- launcher side
def run_mode(job: dict[str, Any], cluster: Any = None) -> dict[str, Any]:
    """Start ``WORLD`` ranks (in the cluster's hosts, or on loopback) and return rank 0's."""
    with tempfile.TemporaryDirectory(prefix="decentralized-") as tmp:
        out = Path(tmp) / "result.json"
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"job": job, "out": str(out)}))
        master = cluster.hosts[0].addr if cluster else "127.0.0.1"
        procs = []
        for rank in range(WORLD):
            env = {
                **os.environ,
                "PYTHONPATH": str(SRC),
                "MASTER_ADDR": master,
                "MASTER_PORT": str(PORT),
                "RANK": str(rank),
                "LOCAL_RANK": "0",
                "WORLD_SIZE": str(WORLD),
                "GLOO_SOCKET_IFNAME": "eth0" if cluster else "lo",
                "OMP_NUM_THREADS": "1",
            }
            cmd = [sys.executable, str(Path(__file__).resolve()), "worker", str(spec)]
            kwargs: dict[str, Any] = {"env": env, "stderr": subprocess.PIPE, "text": True}
            host = cluster.hosts[rank] if cluster else None
            procs.append(host.popen(cmd, **kwargs) if host else subprocess.Popen(cmd, **kwargs))
        for proc in procs:
            _, err = proc.communicate(timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(f"rank failed: {err[-3000:]}")
        return dict(json.loads(out.read_text()))


def table(runs: dict[str, dict[str, Any]], target_at: float, steps: int) -> dict[str, Any]:
    dp = runs["allreduce"]
    target = min((c for c in dp["curve"] if c[0] >= target_at * steps), key=lambda c: c[0])[2]
    dp["bytes_per_step"] = dp["model_bytes"]  # DDP all-reduces every fp32 gradient once a step
    rows = {}
    for mode, run in runs.items():
        reach = next((t for _, t, loss in run["curve"] if loss <= target), None)
        rows[mode] = {
            "bytes_per_worker_per_step": run["bytes_per_step"],
            "bytes_vs_allreduce": run["bytes_per_step"] / dp["bytes_per_step"],
            "final_val_loss": run["curve"][-1][2],
            "val_loss_vs_allreduce": run["curve"][-1][2] / dp["curve"][-1][2],
            "time_to_target_s": reach,
            "train_time_s": run["train_time_s"],
            "step_time_s": run["train_time_s"] / steps,
            # sync gossip: seconds per step the training thread was blocked on the exchange
            "exchange_wait_s": run.get("exchange_wait_s"),
            "max_consensus_distance": max((d for _, d in run["consensus_distance"]), default=0),
            "curve": run["curve"],  # (step, seconds of training, validation loss)
        }
    base = rows["allreduce"]["time_to_target_s"]
    for row in rows.values():
        t = row["time_to_target_s"]
        row["speedup_vs_allreduce"] = base / t if t and base else None
    return {"target_val_loss": target, "target_at": target_at, "rows": rows}


def plot(runs: dict[str, dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for mode, run in runs.items():
        if mode == "allreduce" or not run["consensus_distance"]:
            continue
        steps, dist = zip(*run["consensus_distance"], strict=True)
        ax.plot(steps, dist, ".-" if "localsgd" in mode else "-", label=mode)
    ax.set_xlabel("step (MLP tiny, 4 workers, loopback)")
    ax.set_ylabel("consensus distance: mean ||x_i - x_avg||")
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    from polytrain.testing.cluster import Cluster, LinkSpec, unavailable_reason

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--rate", type=float, default=20.0, help="slow link, Mbit/s")
    parser.add_argument("--gpt-steps", type=int, default=60, help="0: skip the GPT part")
    parser.add_argument("--target-at", type=float, default=0.5, help="fraction of DP's run")
    parser.add_argument("--overlap-rate", type=float, default=200.0, help="Mbit/s")
    parser.add_argument("--overlap-steps", type=int, default=30)
    parser.add_argument("--only", choices=["loopback", "slow", "gpt", "overlap"], default=None)
    args = parser.parse_args()
    result: dict[str, Any] = {"steps": args.steps, "world": WORLD, "rate_mbit": args.rate}
    old = HERE / "results.json"
    if args.only and old.exists():  # keep the other parts of an earlier run
        result = {**json.loads(old.read_text()), **result}

    def sweep(modes: list[str], model: str, steps: int, cluster: Any = None) -> dict[str, Any]:
        runs = {}
        for mode in modes:
            every = args.eval_every if model == "mlp" else steps
            runs[mode] = run_mode(job_dict(mode, model, steps, every), cluster)
            print(mode, json.dumps({k: v for k, v in runs[mode].items() if k != "curve"}))
        return runs

    if args.only in (None, "loopback"):
        runs = sweep(LOOPBACK_MODES, "mlp", args.steps)
        result["loopback"] = table(runs, args.target_at, args.steps)
        result["consensus_distance"] = {m: r["consensus_distance"] for m, r in runs.items()}
        plot(runs, HERE / "consensus.png")
    if args.only in (None, "slow"):
        reason = unavailable_reason()
        if reason:
            print(f"slow link skipped: {reason}")
        else:
            with Cluster(WORLD, link=LinkSpec(rate_mbit=args.rate)) as cluster:
                runs = sweep(SLOW_MODES, "mlp", args.steps, cluster)
            result["slow"] = table(runs, args.target_at, args.steps)
    if args.only in (None, "overlap") and not unavailable_reason():
        with Cluster(WORLD, link=LinkSpec(rate_mbit=args.overlap_rate)) as cluster:
            runs = sweep(OVERLAP_MODES, "gpt", args.overlap_steps, cluster)
        rows = {}
        for mode, run in runs.items():
            rows[mode] = {
                "step_time_s": run["train_time_s"] / args.overlap_steps,
                "exchange_wait_s": run["exchange_wait_s"],
                "bytes_per_worker_per_step": run["bytes_per_step"],
                "val_loss": run["curve"][-1][2],
            }
        result["overlap"] = {"rate_mbit": args.overlap_rate, "steps": args.overlap_steps}
        result["overlap"]["rows"] = rows
    if args.only in (None, "gpt") and args.gpt_steps:
        runs = sweep(GPT_MODES, "gpt", args.gpt_steps)
        dp = runs["allreduce"]["curve"][-1][2]
        rows = {}
        for mode, run in runs.items():
            loss = run["curve"][-1][2]
            rows[mode] = {"val_loss": loss, "vs_allreduce": loss / dp}
        result["gpt"] = {"steps": args.gpt_steps, "rows": rows}
    text = json.dumps(result, indent=1)
    print(text)
    old.write_text(text + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        worker(sys.argv[2])
    else:
        main()

"""Parameter server with a straggler: time to a target loss for async, ssp, sync and all-reduce.

Question: with one worker slowed down (a straggler sleeping ``--delay`` s every step), how long
does each consistency model take to reach a target validation loss, with the same number of
samples (steps x global batch) and the same workers? And how close does the server's traffic
come to the raw point-to-point bandwidth of the same processes?

Peers, all in this script on the same job (MLP tiny, SGD, 3 workers):
- ``allreduce``: polytrain data parallel (DDP) on 3 ranks, the straggler sleeping the same way;
- ``sync``, ``ssp`` (s = 2), ``async``: 1 server + 3 workers, ``ps.straggler_delay_s``.

Time to target = the earliest training time (summed step times since the common start; every
worker validates the parameters it holds every ``--eval-every`` of its steps) at which any
worker's validation loss is at or below the target. The target is the validation loss sync
reaches halfway through the run (``--target-at 0.5``). Raw bandwidth: rank 0 sends ``--bw-mb`` MiB in ``ps.chunk_kb`` chunks to the server
rank with the same c10d calls, before training, inside the async run.

Run: python benchmarks/parameter_server/main.py [--steps 200] [--delay 0.03]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _job(mode: str, args: argparse.Namespace, out_dir: str) -> Any:
    from polytrain.config import job_from_dict

    data: dict[str, Any] = {
        "model": {"name": "mlp", "size": "tiny"},
        "train": {
            "steps": args.steps,
            "global_batch_size": 48,
            "seed": 0,
            "eval_every": args.eval_every,
            "eval_batches": 4,
            "sample_tokens": 0,
        },
        "optim": {"name": "sgd", "lr": 0.2, "schedule": "constant", "grad_clip": 0.0},
        "observe": {"progress": False, "out_dir": out_dir, "log_every": 1000},
        "launch": {"nproc": 3},
    }
    if mode != "allreduce":
        data["parallel"] = {"sync": "ps"}
        data["launch"] = {"nproc": 4}
        data["ps"] = {
            "servers": 1,
            "mode": mode,
            "staleness": 2 if mode == "ssp" else 0,
            "straggler_delay_s": args.delay,
            "chunk_kb": args.chunk_kb,
        }
    return job_from_dict(data)


def _bandwidth(rank: int, world: int, megabytes: int, chunk_kb: int) -> float | None:
    """Raw chunked isend bandwidth rank 0 -> last rank (bytes/s) with the server's own calls."""
    import torch

    from polytrain.comm import ps_wire

    server = world - 1
    if rank not in (0, server):
        return None
    elems = chunk_kb * 1024 // 4
    chunks = megabytes * 1024 // chunk_kb
    buf = torch.ones(elems)
    for _ in range(2):  # warm-up, then the timed round
        start = time.perf_counter()
        if rank == 0:
            ops = [ps_wire.post_send(buf, server, ps_wire.TAG_PROBE + 1) for _ in range(chunks)]
        else:
            ops = [
                ps_wire.post_recv(torch.empty(elems), 0, ps_wire.TAG_PROBE + 1)
                for _ in range(chunks)
            ]
        ps_wire.wait_all(ops)
        seconds = time.perf_counter() - start
    return chunks * elems * 4 / seconds


def _rank(
    rank: int, world: int, mode: str, args: argparse.Namespace, out_dir: str
) -> dict[str, Any]:
    from polytrain.trainer.loop import train

    bandwidth = _bandwidth(rank, world, args.bw_mb, args.chunk_kb) if mode == "async" else None
    if mode == "allreduce" and rank == world - 1 and args.delay > 0:
        # The same straggler for the all-reduce peer: the last rank sleeps every step.
        from polytrain.parallel import spmd as strategy

        step = strategy.SPMDStrategy.train_step

        def slow_step(self: Any, i: int) -> Any:
            time.sleep(args.delay)
            return step(self, i)

        strategy.SPMDStrategy.train_step = slow_step  # type: ignore[method-assign]
    t0 = time.perf_counter()
    result = train(_job(mode, args, out_dir))
    wall = time.perf_counter() - t0
    elapsed, curve = 0.0, []
    for record in result.history:
        elapsed += record["step_time_s"]
        if "val_loss" in record:
            curve.append((record["step"], elapsed, record["val_loss"]))
    worker = not math.isnan(result.final_loss) or mode == "allreduce"
    return {"curve": curve if worker else [], "wall_s": wall, "bandwidth": bandwidth}


def _time_to(curves: list[list[list[float]]], target: float) -> float | None:
    """Earliest training time at which any worker validated at or below ``target``."""
    times = [elapsed for curve in curves for _, elapsed, loss in curve if loss <= target]
    return min(times) if times else None


def main() -> None:
    from polytrain.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--delay", type=float, default=0.03, help="straggler sleep per step (s)")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--chunk-kb", type=int, default=64)
    parser.add_argument("--bw-mb", type=int, default=64)
    parser.add_argument("--target-at", type=float, default=0.5, help="fraction of sync's run")
    args = parser.parse_args()

    runs: dict[str, dict[str, Any]] = {}
    for mode in ("allreduce", "sync", "ssp", "async"):
        with tempfile.TemporaryDirectory(prefix=f"ps-bench-{mode}-") as out_dir:
            world = 3 if mode == "allreduce" else 4
            results = run_distributed(_rank, world, mode, args, out_dir, timeout_s=600)
            run = dict(results[0])
            run["curves"] = [r["curve"] for r in results if r["curve"]]
            if mode != "allreduce":
                stats = json.loads((Path(out_dir) / "ps" / "server0.json").read_text())
                run["server"] = {
                    k: stats[k] for k in ("ps_updates_per_s", "ps_bytes_per_s", "updates", "wall_s")
                }
                run["server"]["max_staleness"] = max(c - m for _, c, m in stats["events"])
                bw = [r["bandwidth"] for r in results if r["bandwidth"]]
                if bw:
                    run["raw_p2p_bytes_per_s"] = min(bw)
            runs[mode] = run
            shown = {k: v for k, v in run.items() if k not in ("curve", "curves")}
            print(mode, json.dumps(shown), flush=True)

    sync_curve = runs["sync"]["curve"]
    target = min(
        (c for c in sync_curve if c[0] >= args.target_at * args.steps), key=lambda c: c[0]
    )[2]
    table = {}
    for mode, run in runs.items():
        reach = _time_to(run["curves"], target)
        table[mode] = {
            "time_to_target_s": reach,
            "rank0_final_val_loss": run["curve"][-1][2],
            "train_time_s": max(c[-1][1] for c in run["curves"]),  # the slowest worker's
        }
    base = table["sync"]["time_to_target_s"]
    for row in table.values():
        t = row["time_to_target_s"]
        row["speedup_vs_sync"] = base / t if t and base else None
    raw = runs["async"].get("raw_p2p_bytes_per_s")
    server = {mode: runs[mode]["server"] for mode in ("sync", "ssp", "async")}
    out = {
        "target_val_loss": target,
        "steps": args.steps,
        "straggler_delay_s": args.delay,
        "table": table,
        "server": server,
        "raw_p2p_bytes_per_s": raw,
        "server_bytes_over_raw": {m: s["ps_bytes_per_s"] / raw for m, s in server.items()}
        if raw
        else None,
    }
    text = json.dumps(out, indent=2)
    print(text)
    (HERE / "results.json").write_text(text + "\n")


if __name__ == "__main__":
    main()

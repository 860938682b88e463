"""Parameter-server sync at wire speed: step time against data parallel, and link use.

Question: for the default job (gpt tiny) and an 11M-parameter GPT (n_embd 384, 6 layers, 6
heads), both with 2 workers, how does a ps sync step (1 dedicated server) compare with a data
parallel step (DDP all-reduce) in the same script, and what fraction of the raw c10d
point-to-point bandwidth, measured in the same processes, does the server's traffic reach?

Runs, interleaved ABBA per model so that a load change hits both peers alike: ps, dp, dp, ps.
Step time = median of the steps after the first (warm-up). In each ps run, before training,
rank 0 sends ``--bw-mb`` MiB to the server rank in chunks of the job's (automatic) chunk size
with the same `comm/ps_wire` calls: the raw bandwidth. Server throughput = the bytes through
the server per step (2 workers x (push + pull) x model bytes) over the step's communication
time (ps step time minus the worker's own forward + backward time, timed in the run).

``--sweep`` adds ps runs at fixed chunk sizes (``--sweep-kb``) beside the automatic one, to
check that the default is within 10% of the best fixed chunk size.

Run: PYTHONPATH=src python benchmarks/parameter_server/speed.py [--steps 4] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODELS: dict[str, dict[str, Any]] = {
    "default": {"name": "gpt", "size": "tiny"},
    "gpt11m": {"name": "gpt", "n_embd": 384, "n_layer": 6, "n_head": 6},
}


def _job(model: str, sync: str, steps: int, chunk_kb: int, out_dir: str) -> Any:
    from polytrain.config import job_from_dict

    data: dict[str, Any] = {
        "model": dict(MODELS[model]),
        "train": {"steps": steps, "seed": 0, "eval_every": 0, "sample_tokens": 0},
        "observe": {"progress": False, "out_dir": out_dir, "log_every": 1000},
        "launch": {"nproc": 3 if sync == "ps" else 2},
    }
    if sync == "ps":
        data["parallel"] = {"sync": "ps"}
        data["ps"] = {"servers": 1, "mode": "sync", "chunk_kb": chunk_kb}
    return job_from_dict(data)


def _bandwidth(rank: int, world: int, megabytes: int, chunk_elems: int) -> float | None:
    """Raw chunked isend bandwidth rank 0 -> last rank (bytes/s), best of 3 rounds."""
    import torch

    from polytrain.comm import ps_wire

    server = world - 1
    if rank not in (0, server):
        return None
    chunks = max(1, megabytes * (1 << 20) // (chunk_elems * 4))
    buf = torch.ones(chunk_elems)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        if rank == 0:
            ops = [ps_wire.post_send(buf, server, ps_wire.TAG_PROBE + 1) for _ in range(chunks)]
        else:
            ops = [
                ps_wire.post_recv(torch.empty(chunk_elems), 0, ps_wire.TAG_PROBE + 1)
                for _ in range(chunks)
            ]
        ps_wire.wait_all(ops)
        best = min(best, time.perf_counter() - start)
    return chunks * chunk_elems * 4 / best


def _rank(
    rank: int, world: int, model: str, sync: str, steps: int, chunk_kb: int, bw_mb: int
) -> dict[str, Any]:
    from polytrain.ps import strategy as ps_strategy
    from polytrain.trainer.loop import train

    compute: list[float] = []
    measured: dict[str, Any] = {"bandwidth": None, "numel": 0}
    if sync == "ps":
        init = ps_strategy.PSStrategy.__init__
        inner = ps_strategy.PSStrategy._forward_backward

        def init_then_measure(self: Any, *a: Any, **kw: Any) -> None:
            init(self, *a, **kw)
            # Once every rank built its strategy: rank 0 and the server time the raw link in
            # the job's own chunk size (a tag nobody else uses; the server's receiver threads
            # wait on their own tags meanwhile).
            measured["numel"] = sum(self.layout.numel(s) for s in range(len(self.servers)))
            measured["bandwidth"] = _bandwidth(rank, world, bw_mb, self.layout.chunk_elems)

        def timed(self: Any, step: int) -> Any:
            t0 = time.perf_counter()
            out = inner(self, step)
            compute.append(time.perf_counter() - t0)
            return out

        ps_strategy.PSStrategy.__init__ = init_then_measure  # type: ignore[method-assign]
        ps_strategy.PSStrategy._forward_backward = timed  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory(prefix="ps-speed-") as out_dir:
        result = train(_job(model, sync, steps, chunk_kb, out_dir))
    times = [r["step_time_s"] for r in result.history][1:]
    return {
        "step_s": statistics.median(times) if times else float("nan"),
        "compute_s": statistics.median(compute[1:]) if len(compute) > 1 else None,
        "bandwidth": measured["bandwidth"],
        "numel": measured["numel"],
    }


def _run(model: str, sync: str, args: argparse.Namespace, chunk_kb: int = 0) -> dict[str, Any]:
    from polytrain.testing import run_distributed

    world = 3 if sync == "ps" else 2
    results = run_distributed(
        _rank, world, model, sync, args.steps, chunk_kb, args.bw_mb, timeout_s=3000
    )
    run: dict[str, Any] = {"step_s": results[0]["step_s"], "load": os.getloadavg()[0]}
    if sync == "ps":
        run["compute_s"] = results[0]["compute_s"]
        run["raw_bytes_per_s"] = results[0]["bandwidth"]
        server_bytes = 2 * 2 * results[0]["numel"] * 4  # 2 workers x (push + pull) x fp32
        comm = max(run["step_s"] - run["compute_s"], 1e-9)
        run["server_bytes_per_s"] = server_bytes / comm
        run["fraction_of_raw"] = run["server_bytes_per_s"] / run["raw_bytes_per_s"]
    print(f"{model} {sync} chunk_kb={chunk_kb}: {json.dumps(run)}", flush=True)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="default,gpt11m")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--bw-mb", type=int, default=64)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-kb", default="256,1024,4096")
    parser.add_argument("--out", default=str(HERE / "speed_results.json"))
    args = parser.parse_args()
    report: dict[str, Any] = {}
    for model in args.models.split(","):
        ps = [_run(model, "ps", args)]
        dp = [_run(model, "dp", args), _run(model, "dp", args)]
        ps.append(_run(model, "ps", args))
        entry: dict[str, Any] = {"ps": ps, "dp": dp}
        entry["ps_over_dp"] = statistics.mean(r["step_s"] for r in ps) / statistics.mean(
            r["step_s"] for r in dp
        )
        entry["fraction_of_raw"] = statistics.mean(r["fraction_of_raw"] for r in ps)
        if args.sweep:
            sizes = [int(kb) for kb in args.sweep_kb.split(",")]
            # ABBA over the sweep: auto, fixed..., fixed reversed..., auto.
            order = [0, *sizes, *reversed(sizes), 0]
            sweep: dict[int, list[float]] = {}
            for kb in order:
                sweep.setdefault(kb, []).append(_run(model, "ps", args, kb)["step_s"])
            means = {kb: statistics.mean(v) for kb, v in sweep.items()}
            best = min(means[kb] for kb in sizes)
            entry["sweep_step_s"] = {str(kb or "auto"): means[kb] for kb in means}
            entry["auto_over_best_fixed"] = means[0] / best
        report[model] = entry
        print(
            f"== {model}: {json.dumps({k: v for k, v in entry.items() if k not in ('ps', 'dp')})}"
        )
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

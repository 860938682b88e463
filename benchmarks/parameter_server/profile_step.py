"""Where a parameter-server sync step's time goes: cProfile of one worker and the server.

Runs ``--steps`` steps of ``--model`` (``default``: the default job, gpt tiny; ``gpt11m``: gpt
n_embd 384, 6 layers, 6 heads) with 2 workers and 1 server (sync mode), profiling rank 0 (a
worker) and rank 2 (the server) over the steps after the first; prints each rank's top
functions by own time and the per-step wall time.

Run: PYTHONPATH=src python benchmarks/parameter_server/profile_step.py --model gpt11m
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from typing import Any

MODELS: dict[str, dict[str, Any]] = {
    "default": {"name": "gpt", "size": "tiny"},
    "gpt11m": {"name": "gpt", "n_embd": 384, "n_layer": 6, "n_head": 6},
}


def job_dict(model: str, steps: int, out_dir: str, sync: str, **ps: Any) -> dict[str, Any]:
    """The benchmark job: ``model`` with 2 workers, ps (1 server) or data parallel."""
    data: dict[str, Any] = {
        "model": dict(MODELS[model]),
        "train": {"steps": steps, "seed": 0, "eval_every": 0, "sample_tokens": 0},
        "observe": {"progress": False, "out_dir": out_dir, "log_every": 1000},
        "launch": {"nproc": 3 if sync == "ps" else 2},
    }
    if sync == "ps":
        data["parallel"] = {"sync": "ps"}
        data["ps"] = {"servers": 1, "mode": "sync", **ps}
    return data


def _rank(rank: int, world: int, model: str, steps: int, out_dir: str) -> dict[str, Any]:
    from polytrain.config import job_from_dict
    from polytrain.trainer.loop import train

    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    result = train(job_from_dict(job_dict(model, steps, out_dir, "ps")))
    profiler.disable()
    wall = time.perf_counter() - t0
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(18)
    times = [r["step_time_s"] for r in result.history]
    return {"wall_s": wall, "step_times": times, "profile": out.getvalue()}


def main() -> None:
    from polytrain.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt11m")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ps-profile-") as out_dir:
        results = run_distributed(_rank, 3, args.model, args.steps, out_dir, timeout_s=1800)
    for rank in (0, 2):
        r = results[rank]
        steps = ", ".join(f"{t:.2f}" for t in r["step_times"])
        print(f"=== rank {rank} ({'server' if rank == 2 else 'worker'}): step times {steps} s")
        print(r["profile"])


if __name__ == "__main__":
    main()

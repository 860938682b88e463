"""Planner on one GPU: calibrate this GPU host, then predicted against measured single-GPU runs.

Issue 13 asks that, whenever a GPU machine is available, the planner be calibrated there and
validated on at least 6 single-GPU layouts. Each case below is one process on one GPU (the
layouts a single device can hold: model size, batch, dtype, recomputation, gradient
accumulation), run through the real trainer (`planner.validate.run_trials`, ``train.device =
"cuda"``); its prediction comes from the same cost model `polytrain plan` uses, with this
host's profile (`CalibrationPlan.accelerator`) on a one-device cluster of the catalog's entry
for this GPU. Peak memory on CUDA is the allocator's high-water mark
(``torch.cuda.max_memory_allocated``), which the cost model's per-rank memory predicts without
a process baseline.

    python benchmarks/planner/gpu.py                  # calibrate (about a minute), run, report
    python benchmarks/planner/gpu.py --cases gpt-m-bf16,mlp-m --steps 8

Without a GPU it says so in one line and exits 2: CI never runs it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from polytrain.config.io import job_from_fields
from polytrain.measure.calibrate import CalibrationPlan, cached_profile
from polytrain.measure.stats import model_stats
from polytrain.planner import cost
from polytrain.planner.catalog import device_key_of
from polytrain.planner.cluster import parse_cluster
from polytrain.planner.types import Layout
from polytrain.planner.validate import TrialSpec, run_trials, summarize

HERE = Path(__file__).resolve().parent

GPT2_SMALL = {"model.n_layer": 12, "model.n_embd": 768, "model.n_head": 12, "model.block_size": 512}
GPT2_MEDIUM = {
    "model.n_layer": 24,
    "model.n_embd": 1024,
    "model.n_head": 16,
    "model.block_size": 512,
}


@dataclass(frozen=True)
class Case:
    name: str
    fields: dict[str, Any]  # job fields (dotted keys) beside train.device = "cuda"
    layout: Layout = field(default_factory=Layout)


def cases() -> list[Case]:
    """From launch-bound (a small GPT in fp32) to compute-bound (a GPT-2-medium shape in bf16)."""
    bf16 = {"train.dtype": "bf16"}
    return [
        Case("gpt-s-fp32", {"model.size": "small", "train.global_batch_size": 32}),
        Case("gpt-m-fp32", {"model.size": "medium", "train.global_batch_size": 32}),
        Case("gpt-m-bf16", {"model.size": "medium", "train.global_batch_size": 32, **bf16}),
        Case("gpt2s-bf16", {**GPT2_SMALL, "train.global_batch_size": 16, **bf16}),
        Case(
            "gpt2s-bf16-recompute",
            {**GPT2_SMALL, "train.global_batch_size": 16, **bf16},
            Layout(recompute=True),
        ),
        Case(
            "gpt2s-bf16-accum4",
            {**GPT2_SMALL, "train.global_batch_size": 32, **bf16},
            Layout(grad_accum=4),
        ),
        Case("gpt2m-bf16", {**GPT2_MEDIUM, "train.global_batch_size": 16, **bf16}),
        Case("gpt2m-fp32", {**GPT2_MEDIUM, "train.global_batch_size": 8}),
        Case(
            "mlp-m-fp32",
            {"model.name": "mlp", "model.size": "medium", "train.global_batch_size": 256},
        ),
    ]


def catalog_key(gpu_name: str) -> str:
    key = device_key_of(gpu_name)
    if key is None:
        raise SystemExit(f"GPU {gpu_name!r} is not in the planner's catalog (devices.toml)")
    return key


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="all", help="comma-separated case names, or 'all'")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--workdir", default="/tmp/polytrain-planner-gpu")
    ap.add_argument("--out", default="", help="default: gpu_results.json in --workdir")
    ap.add_argument("--cache-dir", default="", help="profile cache (default $POLYTRAIN_CACHE)")
    ap.add_argument("--recalibrate", action="store_true")
    ap.add_argument(
        "--trace",
        action="store_true",
        help="each case also writes a Chrome trace (forward, backward, optimizer spans on the "
        "host's clock) to <workdir>/<case>/trace.json",
    )
    ap.add_argument(
        "--smoke-cpu",
        action="store_true",
        help="check this script on a CPU host (quick calibration, train.device = cpu)",
    )
    args = ap.parse_args()
    smoke = args.smoke_cpu
    if not smoke and not torch.cuda.is_available():
        print("benchmarks/planner/gpu.py: no CUDA device here; run it on a GPU host")
        return 2
    known = {c.name: c for c in cases()}
    names = list(known) if args.cases == "all" else [n.strip() for n in args.cases.split(",")]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"--cases: unknown {', '.join(unknown)}; known: {', '.join(known)}")

    gpu = "cpu" if smoke else torch.cuda.get_device_name(0)
    device = "cpu" if smoke else "cuda"
    t0 = time.perf_counter()
    profile, path, fresh = cached_profile(
        CalibrationPlan.quick() if smoke else CalibrationPlan.accelerator(),
        force=args.recalibrate,
        directory=Path(args.cache_dir) if args.cache_dir else None,
        on_progress=lambda what: print(f"  calibrate: {what}", flush=True),
    )
    print(
        f"{gpu}: profile {path} ({'measured' if fresh else 'saved'}, "
        f"{time.perf_counter() - t0:.0f} s); matmul "
        + ", ".join(f"{d} {r / 1e12:.1f} TFLOP/s" for d, r in sorted(profile.matmul_flops.items()))
        + f", copy {profile.mem_bw / 1e9:.0f} GB/s, op {profile.op_s * 1e6:.1f} us",
        flush=True,
    )
    cluster = parse_cluster(f"1x1x{'cpu' if smoke else catalog_key(gpu)}")
    rows: list[dict[str, Any]] = []
    specs: list[TrialSpec] = []
    trials = []
    for name in names:
        case = known[name]
        fields = {**case.fields, "train.device": device}
        if args.trace:
            fields["observe.trace"] = str(Path(args.workdir) / name / "trace.json")
        job = job_from_fields(fields)
        stats = model_stats(job, device=device)  # FLOPs, and the bytes CUDA's kernels save
        env = cost.Env(cluster, job.train.dtype, profile, job.parallel.bucket_mb * 2**20)
        pred = cost.predict(case.layout, stats, env, job.train.global_batch_size)
        spec = TrialSpec(
            case.layout,
            predicted_step_s=pred.step_s,
            predicted_peak_bytes=pred.memory_per_rank,
            label=name,
        )
        (trial,) = run_trials(
            [spec],
            fields,
            Path(args.workdir) / name,
            steps=args.steps,
            warmup=args.warmup,
        )
        specs.append(spec)
        trials.append(trial)
        row: dict[str, Any] = {
            "case": name,
            "params": stats.params,
            "fields": fields,
            "layout": asdict(case.layout),
            "predicted_step_s": pred.step_s,
            "predicted_peak_bytes": pred.memory_per_rank,
            "breakdown": pred.breakdown,
            "measured_step_s": trial.measured_step_s,
            "measured_peak_bytes": trial.peak_bytes,
            "error": trial.error,
        }
        rows.append(row)
        if trial.error:
            print(f"  {name}: failed: {trial.error}", flush=True)
            continue
        print(
            f"  {name:22} {stats.params / 1e6:6.1f}M  step pred {pred.step_s * 1e3:8.1f} ms "
            f"meas {trial.measured_step_s * 1e3:8.1f} ms "
            f"({100 * (pred.step_s / trial.measured_step_s - 1):+4.0f}%)  peak pred "
            f"{pred.memory_per_rank / 2**30:6.2f} GiB meas {trial.peak_bytes / 2**30:6.2f} GiB "
            f"({100 * (pred.memory_per_rank / trial.peak_bytes - 1):+4.0f}%)",
            flush=True,
        )
    summary = summarize(trials)
    ok = [r for r in rows if not r["error"] and math.isfinite(r["measured_step_s"])]
    if ok:
        summary["median_signed_pct_error"] = 100 * statistics.median(
            r["predicted_step_s"] / r["measured_step_s"] - 1 for r in ok
        )
    print(json.dumps(summary))
    out = Path(args.out) if args.out else Path(args.workdir) / "gpu_results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "gpu": gpu,
                "torch": torch.__version__,
                "profile": {
                    "matmul_by_size": profile.matmul_by_size,
                    "mem_bw": profile.mem_bw,
                    "op_s": profile.op_s,
                    "step_costs": profile.step_costs,
                },
                "rows": rows,
                "summary": summary,
            },
            indent=1,
            default=str,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

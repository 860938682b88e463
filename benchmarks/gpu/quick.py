"""One short GPU check: polytrain's CLI step against a plain loop on the same GPT (bf16).

    python benchmarks/gpu/quick.py             # both shapes, eager; OUT=dir for the results
    python benchmarks/gpu/quick.py --profile   # also: torch.profiler tables of one window of
                                               # polytrain's medium step and the plain loop's

Without CUDA it runs a tiny model on the CPU (a check of the script itself).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from polytrain.config.job import JobConfig, ModelConfig
from polytrain.data.datasets import build_datasets
from polytrain.models.registry import block_size_of, build_model

STEPS, WINDOW, BATCH = 30, 5, 16
SHAPES = {
    "small": {"n_layer": 12, "n_embd": 768, "n_head": 12, "block_size": 512},
    "medium": {"n_layer": 24, "n_embd": 1024, "n_head": 16, "block_size": 512},
}
OUT = Path(os.environ.get("OUT", "/tmp/out"))
DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":  # a dry run of the script itself
    SHAPES = {"small": {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 16}}


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def polytrain_ms(name: str, dims: dict[str, int]) -> tuple[float, list[float]]:
    run = OUT / f"pt-{name}"
    sets = {
        "train.device": f'"{DEV}"',
        "train.dtype": '"bf16"',
        "train.steps": str(STEPS),
        "train.global_batch_size": str(BATCH),
        "train.eval_every": "0",
        "train.eval_batches": "1",
        "train.sample_tokens": "0",
        "observe.log_every": str(WINDOW),
        "observe.out_dir": f'"{run}"',
        **{f"model.{k}": str(v) for k, v in dims.items()},
    }
    cmd = [sys.executable, "-m", "polytrain", "train", "--nproc", "1", "--no-progress"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    if p.returncode:
        print(p.stdout[-2000:], p.stderr[-3000:])
        return float("nan"), []
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    windows = [r["step_time_s"] * 1e3 for r in recs if r["step"] % WINDOW == 0]
    mfu = [r.get("mfu") for r in recs]
    print(name, "polytrain windows ms", [round(w, 1) for w in windows], "mfu", mfu[-1])
    return statistics.median(windows[2:]), windows


def plain_ms(name: str, dims: dict[str, int], compiled: bool) -> float:
    job = JobConfig()
    job.model = ModelConfig(name="gpt", **dims)  # type: ignore[arg-type]
    _, _, spec = build_datasets(job.data, block_size_of(job.model))
    model = build_model(job.model, spec, 0).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99), fused=True)
    fwd = torch.compile(model) if compiled else model
    t = dims["block_size"]
    x = torch.randint(0, spec.vocab_size, (BATCH, t), device=DEV)
    y = torch.randint(0, spec.vocab_size, (BATCH, t), device=DEV)
    windows = []
    sync()
    t0 = time.perf_counter()
    for step in range(STEPS):
        with torch.autocast(DEV, dtype=torch.bfloat16):
            loss = model.loss(fwd(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % WINDOW == 0:
            sync()
            now = time.perf_counter()
            windows.append((now - t0) / WINDOW * 1e3)
            t0 = now
    print(name, "plain", "compiled" if compiled else "eager", [round(w, 1) for w in windows])
    return statistics.median(windows[2:])


def profile_medium() -> None:
    """torch.profiler over polytrain's medium run in this process (the loop itself, one rank)
    and over the plain loop: the top operators by device time, and by host time, of each."""
    from torch.profiler import ProfilerActivity, profile

    from polytrain.config.io import job_from_dict
    from polytrain.trainer.loop import train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29655", RANK="0", WORLD_SIZE="1")
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dims = SHAPES["medium"] if "medium" in SHAPES else SHAPES["small"]
    job = job_from_dict(
        {
            "model": {"name": "gpt", **dims},
            "train": {
                "device": DEV,
                "dtype": "bf16",
                "steps": 10,
                "global_batch_size": BATCH,
                "eval_every": 0,
                "eval_batches": 1,
                "sample_tokens": 0,
            },
            "observe": {"progress": False, "out_dir": str(OUT / "pt-profile"), "log_every": 5},
            "launch": {"nproc": 1},
        }
    )
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
    for label, run in (
        ("polytrain", lambda: train(job)),
        ("plain", lambda: plain_ms("medium", dims, False)),
    ):
        with profile(activities=activities) as prof:
            run()
        sort = "cuda_time_total" if DEV == "cuda" else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=25)
        host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        (OUT / f"profile-{label}.txt").write_text(table + "\n\n" + host)
        print(label, "profile", table[:3000], flush=True)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    if "--profile" in sys.argv:
        profile_medium()
    print(torch.__version__, torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu")
    results = {}
    for name, dims in SHAPES.items():
        pt, _ = polytrain_ms(name, dims)
        eager = plain_ms(name, dims, compiled=False)
        row = {"polytrain_ms": pt, "plain_eager_ms": eager, "ratio_eager": pt / eager}
        if name == "small":
            row["plain_compiled_ms"] = plain_ms(name, dims, compiled=True)
        results[name] = row
        print(name, row, flush=True)
    (OUT / "gpu_quick.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""Recomputation on one GPU: forward + backward of a GPT-2-small-shaped model in bf16, plain
against recomputed (`parallel.recompute`), the ratio, CUDA's sync debug mode over one
recomputed step, and the torch profiler's busiest host operators. The planner prices a
recomputed block as one more forward; docs/planner.md "Current accuracy" records what this
measured (2.35x, host-bound).

    python benchmarks/planner/gpu_recompute.py
"""

import sys
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from polytrain.config.io import job_from_dict
from polytrain.core.recompute import apply_recompute
from polytrain.data.datasets import build_datasets
from polytrain.models.base import one_input
from polytrain.models.registry import block_size_of, build_model

if not torch.cuda.is_available():
    print("benchmarks/planner/gpu_recompute.py: no CUDA device here; run it on a GPU host")
    sys.exit(2)
dev = torch.device("cuda")
job = job_from_dict(
    {
        "model": {"n_layer": 12, "n_embd": 768, "n_head": 12, "block_size": 512},
        "train": {"dtype": "bf16"},
    }
)
train, _, spec = build_datasets(job.data, block_size_of(job.model))
x, y = train.get(torch.arange(16))
x = one_input(x).to(dev)
y = y.to(dev)


def run(model: torch.nn.Module, n: int = 10) -> float:
    """Mean seconds of one forward + backward over ``n`` after 3 warm-ups."""

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.loss(model(x), y)
        loss.backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


m = build_model(job.model, spec, 0).to(dev)
plain = run(m)
apply_recompute(m)
rec = run(m)
torch.cuda.set_sync_debug_mode("warn")
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = m.loss(m(x), y)
    loss.backward()
torch.cuda.set_sync_debug_mode(0)
print(
    f"fwd+bwd plain {plain * 1e3:.1f} ms, recompute {rec * 1e3:.1f} ms, "
    f"ratio {rec / plain:.2f}; sync warnings in one recomputed step: {len(w)}"
)
for item in w[:5]:
    print("  ", str(item.message)[:200], item.filename, item.lineno)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = m.loss(m(x), y)
    loss.backward()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))

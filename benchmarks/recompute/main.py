"""Activation recomputation policies: peak activation memory and step time against none.

Question: what does each ``parallel.recompute`` policy (`core/recompute.py`) save and cost on
the same model and batch? The peer is the same model without recomputation, in the same
process; each result is a ratio to it. Step = forward, backward, AdamW (torch's default on the
CPU, fused on a GPU). Memory is the peak of tensor bytes alive during forward and backward
above what lives before the step (weights, gradients, optimizer state): on a GPU
``torch.cuda.max_memory_allocated``; on the CPU a dispatch mode that counts every op's output
storage until it is freed (``LiveBytes``; torch's CPU allocator keeps no statistics).

Run: python benchmarks/recompute/main.py [--device cpu|cuda] [--size small] [--steps 12]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from polytrain._torch_private import TorchDispatchMode
from polytrain.config import JobConfig
from polytrain.config.job import ModelConfig
from polytrain.config.parallel import recompute_policy
from polytrain.core.recompute import apply_recompute
from polytrain.data.datasets import build_datasets
from polytrain.models.base import BlockModel
from polytrain.models.registry import block_size_of, build_model

HERE = Path(__file__).resolve().parent
POLICIES = ("none", "full", "every:2", "ops")


class LiveBytes(TorchDispatchMode):
    """Bytes of op outputs alive, and their peak: each output storage is counted once, until
    the last tensor that views it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, int] = {}  # storage pointer -> tensors alive on it

    def _release(self, ptr: int, nbytes: int) -> None:
        self._refs[ptr] -= 1
        if self._refs[ptr] == 0:
            del self._refs[ptr]
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if ptr not in self._refs:
                self._refs[ptr] = 0
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            self._refs[ptr] += 1
            weakref.finalize(t, self._release, ptr, nbytes)
        return out


def _model(size: str, device: str) -> tuple[BlockModel, int, int]:
    job = JobConfig()
    job.model = ModelConfig(name="gpt", size=size)
    _, _, spec = build_datasets(job.data, block_size_of(job.model))
    model = build_model(job.model, spec, 0).to(device)
    return model, spec.vocab_size, block_size_of(job.model)


def _step(model: BlockModel, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model.loss(model(x), x).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _timed_step(model: BlockModel, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    cuda = x.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    _step(model, opt, x)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _peak_bytes(model: BlockModel, x: torch.Tensor) -> int:
    if x.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        model.loss(model(x), x).backward()
        return torch.cuda.max_memory_allocated() - before
    with LiveBytes() as live:
        model.loss(model(x), x).backward()
    return live.peak


def measure(base: BlockModel, x: torch.Tensor, steps: int) -> list[dict[str, Any]]:
    """Every policy's model, stepped in turn (one step each, round after round, so that a
    busy machine slows them alike); the median step and the peak of one more step each."""
    models = {p: apply_recompute(copy.deepcopy(base), recompute_policy(p)) for p in POLICIES}
    opts = {
        p: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=x.device.type == "cuda")
        for p, m in models.items()
    }
    times: dict[str, list[float]] = {p: [] for p in POLICIES}
    for round_ in range(3 + steps):  # 3 warm-up rounds: optimizer state exists from here on
        for p in POLICIES:
            t = _timed_step(models[p], opts[p], x)
            if round_ >= 3:
                times[p].append(t)
    rows = []
    for p in POLICIES:
        peak = _peak_bytes(models[p], x)
        opts[p].zero_grad(set_to_none=True)
        rows.append(
            {"policy": p, "step_ms": statistics.median(times[p]) * 1e3, "peak_mib": peak / 2**20}
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", default="small", help="gpt size: tiny, small, medium")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=HERE / "results.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.device == "cpu":
        torch.set_num_threads(1)
    base, vocab, block = _model(args.size, args.device)
    x = torch.randint(0, vocab, (args.batch, block), device=args.device)
    rows = measure(base, x, args.steps)
    ref = rows[0]
    print(f"gpt {args.size}, batch {args.batch} x {block}, {args.device}")
    print(f"{'policy':10} {'step ms':>9} {'x none':>7} {'peak MiB':>9} {'x none':>7}")
    for row in rows:
        row["time_ratio"] = row["step_ms"] / ref["step_ms"]
        row["memory_ratio"] = row["peak_mib"] / ref["peak_mib"]
        print(
            f"{row['policy']:10} {row['step_ms']:9.1f} {row['time_ratio']:7.2f} "
            f"{row['peak_mib']:9.1f} {row['memory_ratio']:7.2f}"
        )
    machine = (
        torch.cuda.get_device_name(0)
        if args.device == "cuda"
        else f"{platform.processor() or platform.machine()}, 1 thread"
    )
    result = {
        "model": f"gpt {args.size}",
        "batch": args.batch,
        "device": args.device,
        "machine": machine,
        "torch": torch.__version__,
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

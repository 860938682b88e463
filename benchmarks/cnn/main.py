"""Convolutional networks (issue 17): hybrid against pure data parallel, spatial against one
process. Results as ratios; see README.md for the questions, the command and the table.

1. ``hybrid``: the AlexNet-style ``cnn`` (size small: 4 convolution stages, two 1024-wide fully
   connected layers; 3.4 M parameters, 92 % of them in the Linear layers) on the digits, global
   batch 64, two emulated hosts with one rank each (polytrain.testing.cluster: network
   namespaces, ``tc`` shaped links). Pure data parallel (DDP) against ``parallel.hybrid =
   ['auto']`` over an unlimited link and a 1 Gbit/s one. Bytes per step are read from host 0's
   ``eth0`` counters (both directions) and differenced between a short and a long run, so
   start-up, evaluation and the final weight gather cancel; the step time is the median of the
   long run's steps. Needs root (network namespaces).
2. ``spatial``: the ``resnet`` (tiny) on scikit-learn's two sample photographs (424 x 640, RGB)
   in one process and split over 2 and 4 ranks (gloo, this machine): bytes autograd saves for
   backward per rank (`pipeline.saved_tensors.count_saved_bytes`, parameters excluded) and the
   median time of forward + backward. The one-process peer uses the same BatchNorm layers as
   the split runs (`GlobalBatchNorm`, which saves more than torch's fused kernel; that peer,
   ``single_native_bn``, is reported too).

    python3 benchmarks/cnn/main.py                    # both -> results.json
    python3 benchmarks/cnn/main.py --only spatial     # or --only hybrid
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SRC = ROOT / "src"
PORT = 29680

# ----------------------------------------------------------------------------- 1. hybrid
JOB = [
    "--model", "cnn", "--size", "small", "--data", "digits", "--batch-size", "64",
    "--eval-every", "0", "--no-progress", "--set", "train.eval_batches=1",
    "--set", "observe.log_every=1", "--set", "optim.warmup_steps=0",
]  # fmt: skip
LAYOUTS = {"dp": [], "hybrid": ["--set", "parallel.hybrid=['auto']"]}


def _eth0_bytes(host: Any) -> int:
    """rx + tx bytes of the host's eth0 (its one link to the switch)."""
    for line in host.run(["cat", "/proc/net/dev"]).stdout.splitlines():
        if line.strip().startswith("eth0:"):
            fields = line.split(":", 1)[1].split()
            return int(fields[0]) + int(fields[8])
    raise RuntimeError("no eth0 in the host's namespace")


def _run_pair(cluster: Any, steps: int, extra: list[str], work: Path) -> tuple[int, list[float]]:
    """Train on the two hosts; (bytes through host 0's link, host 0's per-step times)."""
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{ROOT}"}
    endpoint = f"{cluster.hosts[0].addr}:{PORT}"
    before = _eth0_bytes(cluster.hosts[0])
    procs = []
    for host in cluster.hosts:
        out = work / f"run-{steps}-{time.monotonic_ns()}-{host.index}"
        args = [*JOB, "--steps", str(steps), "--nproc", "1", "--nnodes", "2", "--node-rank",
                str(host.index), "--rdzv-endpoint", endpoint, "--out-dir", str(out), *extra]  # fmt: skip
        cmd = [sys.executable, "-m", "polytrain.cli.app", "train", *args]
        procs.append((out, host.popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)))  # fmt: skip
    for _, proc in procs:
        text, _ = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"node failed ({proc.returncode}):\n{text[-3000:]}")
    moved = _eth0_bytes(cluster.hosts[0]) - before
    records = [json.loads(line) for line in (procs[0][0] / "metrics.jsonl").open()]
    return moved, [r["step_time_s"] for r in records]


def hybrid(short: int, long: int) -> dict[str, Any]:
    from polytrain.testing.cluster import Cluster, LinkSpec, unavailable_reason

    reason = unavailable_reason()
    if reason:
        return {"skipped": reason}
    results: dict[str, Any] = {}
    for link_name, link in {"unlimited": LinkSpec(), "1gbit": LinkSpec(rate_mbit=1000)}.items():
        with Cluster(2, link=link) as cluster, tempfile.TemporaryDirectory() as tmp:
            for layout, extra in LAYOUTS.items():
                b_short, _ = _run_pair(cluster, short, extra, Path(tmp))
                b_long, times = _run_pair(cluster, long, extra, Path(tmp))
                row = {
                    "bytes_per_step": (b_long - b_short) / (long - short),
                    "median_step_s": statistics.median(times[1:]),
                }
                results[f"{link_name}/{layout}"] = row
                print(link_name, layout, row, flush=True)
        dp, hy = results[f"{link_name}/dp"], results[f"{link_name}/hybrid"]
        results[f"{link_name}/ratio"] = {
            "bytes_dp_over_hybrid": dp["bytes_per_step"] / hy["bytes_per_step"],
            "speedup_hybrid_over_dp": dp["median_step_s"] / hy["median_step_s"],
        }
    return results


# ----------------------------------------------------------------------------- 2. spatial
def _photos() -> torch.Tensor:
    """scikit-learn's two sample photographs, (2, 3, 424, 640) in [0, 1] (rows cut to 424 so
    every band survives the strides)."""
    from sklearn.datasets import load_sample_images

    images = np.stack(load_sample_images().images)[:, :424].astype(np.float32) / 255.0
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()


def _spatial_measure(k: int, rank: int, reps: int, global_bn: bool = True) -> dict[str, float]:
    from polytrain.comm.init import new_group
    from polytrain.core.batchnorm import convert_batchnorm
    from polytrain.data.datasets import DataSpec
    from polytrain.models.cnn import build_resnet
    from polytrain.parallel.spatial import apply_spatial
    from polytrain.pipeline.saved_tensors import count_saved_bytes, storage_keys

    torch.manual_seed(0)
    x = _photos()
    y = torch.tensor([0, 1])
    spec = DataSpec(kind="pairs", input_shape=tuple(x.shape[1:]), num_outputs=2)
    model = build_resnet(spec, n_layer=2, width=16)
    if k > 1:
        world = new_group(list(range(k)))
        convert_batchnorm(model, world)
        apply_spatial(model, new_group(list(range(k))), world, rank, k)
    elif global_bn:  # the same BatchNorm layers as the split runs (one rank: no all-reduce)
        convert_batchnorm(model, None)
    exclude = storage_keys([*model.parameters(), *model.buffers()])
    saved, times = 0, []
    for _ in range(reps + 1):
        start = time.perf_counter()
        with count_saved_bytes(exclude) as counted:
            loss = model.loss(model(x), y)
        loss.backward()
        times.append(time.perf_counter() - start)
        saved = counted.bytes
    return {"saved_bytes": float(saved), "step_s": statistics.median(times[1:])}


def _spatial_rank(rank: int, world_size: int, reps: int) -> dict[str, float]:
    torch.set_num_threads(1)
    return _spatial_measure(world_size, rank, reps)


def spatial(reps: int) -> dict[str, Any]:
    from polytrain.testing import run_distributed

    torch.set_num_threads(1)
    single = _spatial_measure(1, 0, reps)
    native = _spatial_measure(1, 0, reps, global_bn=False)
    results: dict[str, Any] = {"single": single, "single_native_bn": native}
    for k in (2, 4):
        per_rank = run_distributed(_spatial_rank, k, reps, timeout_s=900)
        worst = max(r["saved_bytes"] for r in per_rank)
        results[f"spatial{k}"] = {
            "saved_bytes_max_rank": worst,
            "memory_ratio": worst / single["saved_bytes"],
            "target_ratio": 1 / k,
            "step_s_max_rank": max(r["step_s"] for r in per_rank),
            "speedup": single["step_s"] / max(r["step_s"] for r in per_rank),
        }
        print(f"spatial {k}", results[f"spatial{k}"], flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["hybrid", "spatial"])
    parser.add_argument("--short", type=int, default=5)
    parser.add_argument("--long", type=int, default=25)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "results.json"))
    args = parser.parse_args()
    results: dict[str, Any] = {"torch": torch.__version__, "cores": os.cpu_count()}
    if args.only in (None, "spatial"):
        results["spatial"] = spatial(args.reps)
    if args.only in (None, "hybrid"):
        results["hybrid"] = hybrid(args.short, args.long)
    Path(args.out).write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(json.dumps(results, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()

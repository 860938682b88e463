"""Data parallel: polytrain's step against hand-written DDP, and gradient all-reduce bandwidth.

Question: does polytrain's data-parallel step (DDP inside polytrain's strategy, data slicing,
loss averaging, LR schedule) cost anything over a plain DDP loop on the same model, data and
processes? And does the gradient all-reduce reach the bus bandwidth of gloo's raw all_reduce on
the same message sizes?

Run: python benchmarks/data_parallel/main.py [--world 2] [--steps 30] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _job(world: int, size: str) -> Any:
    from polytrain.config import job_from_dict

    return job_from_dict(
        {
            "model": {"name": "gpt", "size": size},
            "train": {"global_batch_size": 16 * world, "eval_every": 0, "sample_tokens": 0},
            "observe": {"progress": False},
            "launch": {"nproc": world},
        }
    )


def _timed_hook(log: list[tuple[int, float]]):  # type: ignore[no-untyped-def]
    """A DDP comm hook that all-reduces like the default one and records (bytes, seconds)."""
    import torch
    import torch.distributed as dist

    def hook(
        group: dist.ProcessGroup, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        start = time.perf_counter()
        buffer.div_(group.size())
        fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()

        def done(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            log.append((buffer.numel() * buffer.element_size(), time.perf_counter() - start))
            return f.value()[0]

        return fut.then(done)

    # DDP inspects the annotations at runtime; this module's are strings (PEP 563).
    hook.__annotations__ = {"group": dist.ProcessGroup, "bucket": dist.GradBucket}
    return hook


def _rank(rank: int, world: int, steps: int, reps: int, size: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from polytrain.comm.init import init_distributed
    from polytrain.core.optim import build_optimizer
    from polytrain.data import Batches, build_datasets
    from polytrain.models.registry import block_size_of, build_model
    from polytrain.trainer.build import build_strategy

    job = _job(world, size)
    ctx = init_distributed()
    train, val, spec = build_datasets(job.data, block_size_of(job.model))
    batches = Batches(train, val, job.train.global_batch_size, job.train.seed)
    ours = build_strategy(job, ctx, build_model(job.model, spec, 0), batches)

    plain_model = build_model(job.model, spec, 0)
    plain = DDP(plain_model, bucket_cap_mb=job.parallel.bucket_mb, gradient_as_bucket_view=True)
    plain_opt = build_optimizer(plain.parameters(), job.optim)

    def plain_step(step: int) -> None:
        x, y = batches.train(step, rank, world)
        plain_opt.zero_grad(set_to_none=True)
        loss = plain_model.loss(plain(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), job.optim.grad_clip)
        plain_opt.step()

    def run(fn: Any, start: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for step in range(start, start + steps):
            fn(step)
        dist.barrier()
        return steps * job.train.global_batch_size / (time.perf_counter() - t0)

    run(ours.train_step, 0)  # warm-up both
    run(plain_step, 0)
    ours_sps, plain_sps = [], []
    for rep in range(reps):  # interleaved ABBA, so drift in machine load hits both alike
        first, second = (
            (ours.train_step, plain_step) if rep % 2 == 0 else (plain_step, ours.train_step)
        )
        a, b = run(first, 1000 + rep * steps), run(second, 1000 + rep * steps)
        ours_sps.append(a if first is ours.train_step else b)
        plain_sps.append(b if first is ours.train_step else a)

    # Gradient all-reduce bandwidth: time each bucket's all-reduce inside DDP ... Both sides
    # take the fastest of `probes` repetitions: a rank that reaches a collective late makes its
    # peer wait, and the minimum is the repetition least disturbed by that skew.
    probes = 20
    log: list[tuple[int, float]] = []
    probe_model = build_model(job.model, spec, 0)
    probe = DDP(probe_model, bucket_cap_mb=job.parallel.bucket_mb)
    probe.register_comm_hook(dist.group.WORLD, _timed_hook(log))
    for step in range(probes):
        x, y = batches.train(step, rank, world)
        dist.barrier()
        probe_model.loss(probe(x), y).backward()
    per_step = len(log) // probes
    sizes = [b for b, _ in log[:per_step]]
    ddp_time = min(sum(t for _, t in log[i * per_step : (i + 1) * per_step]) for i in range(probes))
    # ... and gloo's raw all_reduce on the same sizes, one after another.
    buffers = [torch.randn(b // 4) for b in sizes]
    raw_times = []
    for _ in range(probes):
        dist.barrier()
        t0 = time.perf_counter()
        for buf in buffers:
            dist.all_reduce(buf)
        raw_times.append(time.perf_counter() - t0)
    factor = 2 * (world - 1) / world  # ring all-reduce bus-bandwidth factor
    total = sum(sizes)
    return {
        "ours_samples_per_s": statistics.median(ours_sps),
        "plain_ddp_samples_per_s": statistics.median(plain_sps),
        "bucket_bytes": sizes,
        "ddp_busbw_MBps": total * factor / ddp_time / 1e6,
        "raw_busbw_MBps": total * factor / min(raw_times) / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--size", default="tiny")
    args = parser.parse_args()

    from polytrain.testing import run_distributed

    r = run_distributed(_rank, args.world, args.steps, args.reps, args.size, timeout_s=1800)[0]
    result = {
        "world": args.world,
        "model": f"gpt-{args.size}",
        "throughput_ratio": r["ours_samples_per_s"] / r["plain_ddp_samples_per_s"],
        "busbw_ratio": r["ddp_busbw_MBps"] / r["raw_busbw_MBps"],
        **{k: v for k, v in r.items() if k != "bucket_bytes"},
        "num_buckets": len(r["bucket_bytes"]),
        "gradient_bytes": sum(r["bucket_bytes"]),
    }
    print(json.dumps(result, indent=2))
    (HERE / "results.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

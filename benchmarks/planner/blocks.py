"""The flops variant's price of each block against the block timed, in one process.

A profile's compute figures are measured in this process (square matmuls, memory bandwidth, the
operator call, and where this polytrain has them the CPU kernel probes of `measure.kernels`:
[Note: cold operands], [Note: attention kernels], [Note: elementwise kernels]), then each
block of the model is priced by `Env.fwd_s` / `Env.bwd_s` from its counted statistics
(`model_stats(device="cpu")`) and timed by `model_stats(measure=True)` at the same batch, one
intra-op thread. Load moves both the same way within a run; compare runs at similar load.

    PYTHONPATH=src:. python benchmarks/planner/blocks.py --models gpt,mlp --batch 32

Results and what they showed: docs/planner.md "Compute".
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from polytrain.config.job import JobConfig, ModelConfig
from polytrain.measure import calibrate as cal
from polytrain.measure.calibrate_ranks import matmul_rates, matmul_rounds
from polytrain.measure.stats import model_stats
from polytrain.planner.cluster import parse_cluster
from polytrain.planner.cost.common import Env
from polytrain.planner.types import HostProfile


def profile_now() -> HostProfile:
    """The compute figures of a CPU `HostProfile`, measured now (one process alone)."""
    cpu = torch.device("cpu")
    rounds = matmul_rounds((128, 256, 512, 1024), ("fp32",), cpu, 0.3, 1)
    by_size = {n: rate for (_, n), (rate, _) in matmul_rates(rounds).items()}
    mem_bw, _ = cal._mem_bw(256 * 2**20, cpu, 0.3)
    extra: dict[str, Any] = {}
    if "gemm_by_size" in HostProfile.__dataclass_fields__:  # this polytrain has the kernels
        from polytrain.measure.kernels import kernel_rates

        plan = cal.CalibrationPlan()
        gemm, attention, elementwise = kernel_rates(
            plan.gemm_sizes,
            plan.attention_lengths,
            plan.attention_heads,
            plan.kernel_budget_s,
            {},
        )
        extra = {"gemm_by_size": gemm, "attention_rates": attention, "elementwise_s": elementwise}
    return HostProfile(
        fingerprint="now",
        device="cpu",
        matmul_flops={"fp32": by_size[1024]},
        matmul_by_size={"fp32": by_size},
        matmul_concurrent={1: by_size[1024]},
        mem_bw=mem_bw,
        op_s=cal._op_seconds(cpu, 0.3),
        **extra,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt,mlp")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"load {os.getloadavg()[0]:.2f}", flush=True)
    env = Env(parse_cluster("1x1xcpu"), "fp32", profile_now())
    batch = args.batch
    for name in args.models.split(","):
        job = JobConfig(model=ModelConfig(name=name))
        counted = model_stats(job, device="cpu")
        timed = model_stats(job, device="cpu", measure=True, batch=batch, repeats=args.repeats)
        total_p = total_m = 0.0
        for c, m in zip(counted.blocks, timed.blocks, strict=True):
            fwd, bwd = env.fwd_s(c, batch), env.bwd_s(c, batch)
            assert m.fwd_s is not None and m.bwd_s is not None
            mf, mb = m.fwd_s * batch, m.bwd_s * batch
            total_p, total_m = total_p + fwd + bwd, total_m + mf + mb
            print(
                f"{name} {c.name:9s} predicted fwd {fwd * 1e3:7.2f} bwd {bwd * 1e3:7.2f} | "
                f"measured fwd {mf * 1e3:7.2f} bwd {mb * 1e3:7.2f} ms | "
                f"{(fwd + bwd) / (mf + mb) - 1:+.1%}"
            )
        print(
            f"{name} all blocks: predicted {total_p * 1e3:.1f} ms, measured {total_m * 1e3:.1f}"
            f" ms, {total_p / total_m - 1:+.1%} (load {os.getloadavg()[0]:.2f})",
            flush=True,
        )


if __name__ == "__main__":
    main()

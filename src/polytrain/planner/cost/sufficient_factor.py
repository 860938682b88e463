"""Sufficient-factor exchange ("late multiply") for Linear layers.

Xie et al., "Distributed Machine Learning via Sufficient Factor Broadcasting", 2015; Poseidon
(Zhang et al., ATC 2017). A Linear layer's weight gradient over a batch of R rows is
``sum_r u_r v_r^T`` (u: output gradient, v: input). Instead of all-reducing the
``fan_in x fan_out`` matrix, each of N workers all-gathers its R (fan_in + fan_out) factors and
every worker multiplies them out itself: 2 N R fan_in fan_out extra FLOPs. It pays when
N R (fan_in + fan_out) is well below 2 fan_in fan_out. Derivation: docs/planner.md.
"""

from __future__ import annotations

from polytrain.planner.cost.common import Env
from polytrain.planner.types import BlockStats

__all__ = ["dense_s", "sf_block_s", "sf_s"]


def dense_s(env: Env, fan_in: int, fan_out: int, dp: int, dtype_bytes: int) -> float:
    """All-reduce of the dense gradient (weight and bias)."""
    return env.collective_s("all_reduce", (fan_in * fan_out + fan_out) * dtype_bytes, dp, 1)


def sf_s(env: Env, fan_in: int, fan_out: int, rows: float, dp: int, dtype_bytes: int) -> float:
    """All-gather of every worker's factors, then the multiply that rebuilds the gradient."""
    gathered = dp * rows * (fan_in + fan_out) * dtype_bytes
    multiply = 2.0 * dp * rows * fan_in * fan_out / env.flops_rate
    return env.collective_s("all_gather", gathered, dp, 1) + multiply


def sf_block_s(
    env: Env, block: BlockStats, samples: float, dp: int, dtype_bytes: int
) -> tuple[float, float]:
    """(seconds with late multiply, bytes left to the ordinary all-reduce) for one block.

    Layers where the factors are larger than the matrix keep the dense all-reduce (the
    runtime's ``auto``); the block's other parameters (norms, embeddings) always do.
    """
    rows = samples * block.rows_per_sample
    secs = 0.0
    dense_bytes = float(block.param_bytes)
    for fan_in, fan_out in block.linears:
        sf = sf_s(env, fan_in, fan_out, rows, dp, dtype_bytes)
        if sf < dense_s(env, fan_in, fan_out, dp, dtype_bytes):
            secs += sf
            dense_bytes -= (fan_in * fan_out + fan_out) * dtype_bytes
    return secs, max(dense_bytes, 0.0)

"""A CPU host profile and a model of equal blocks for the cost model's unit tests (pure)."""

from __future__ import annotations

from polytrain.planner.types import BlockStats, HostProfile, ModelStats


def cpu_profile(**extra: object) -> HostProfile:
    """10 GFLOP/s fp32 alone (6 and 2 with 2 and 4 processes at once), 10 GB/s, plus ``extra``."""
    fields: dict[str, object] = {
        "fingerprint": "test",
        "device": "cpu",
        "matmul_flops": {"fp32": 10e9},
        "mem_bw": 1e10,
        "matmul_concurrent": {1: 10e9, 2: 6e9, 4: 2e9},
    }
    fields.update(extra)
    return HostProfile(**fields)  # type: ignore[arg-type]


def equal_blocks(n: int, width: int, tokens: int, *, output_bytes: float) -> ModelStats:
    """``n`` identical one-Linear blocks (``width`` x ``width``, ``tokens`` rows a sample;
    AdamW: two states a parameter), each sending ``output_bytes`` a sample to the next."""
    block = BlockStats(
        name="linear",
        params=width * width,
        param_bytes=4 * width * width,
        fwd_flops=2.0 * tokens * width * width,
        saved_bytes=12.0 * tokens * width,
        output_bytes=output_bytes,
        linears=((width, width),),
        rows_per_sample=tokens,
        tensors=1,
    )
    return ModelStats("equal", tuple(block for _ in range(n)))

"""A CPU host profile for the cost model's unit tests (pure)."""

from __future__ import annotations

from polytrain.planner.types import HostProfile


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

"""`choose_partition("auto")` gives every rank rank 0's partition, or rank 0's error."""

from __future__ import annotations

from typing import Any

import pytest

from polytrain.testing import run_distributed
from tests.conftest import small_job

pytestmark = pytest.mark.slow


def _choose(rank: int, world_size: int) -> list[dict[str, Any]]:
    import torch

    from polytrain.data.datasets import DataSpec
    from polytrain.errors import PartitionError
    from polytrain.models.mlp import build_mlp
    from polytrain.pipeline.profile import choose_partition

    torch.manual_seed(0)
    # a deliberately lopsided model: block 2 is 16x wider than the others
    model = build_mlp(DataSpec(kind="tokens", vocab_size=32), n_layer=4, width=64, block_size=8)
    model.blocks[2] = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.Linear(1024, 64))
    sample = (torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8)))
    out: list[dict[str, Any]] = []
    for limit_mb in (0.0, 0.01):  # no limit, then a limit nothing fits
        job = small_job(pipeline={"partition": "auto", "memory_limit_mb": limit_mb})
        try:
            out.append({"counts": choose_partition(job, model, sample, 3, verbose=rank == 0)})
        except PartitionError as exc:
            out.append({"error": str(exc)})
    return out


def test_every_rank_gets_rank_zeros_partition_or_error() -> None:
    out = run_distributed(_choose, 2, timeout_s=90)
    assert out[0] == out[1]
    found, failed = out[0]
    assert "counts" in found and sum(found["counts"]) == 6, found
    assert "no 3-stage partition fits" in failed["error"]


def test_auto_partition_training_matches_single_process() -> None:
    # profiling on rank 0 must leave no trace: no .grad, same RNG, same buffers (1f1b, m 4)
    from polytrain.testing import assert_state_close, run_job

    model = {"name": "mlp", "n_layer": 4}
    ref = run_job(small_job(model=model))
    out = run_job(
        small_job(
            model=model,
            parallel={"pp": 2},
            pipeline={"partition": "auto", "microbatches": 4},
            launch={"nproc": 2},
        )
    )
    assert_state_close(out["state"], ref["state"], atol=1e-5)
    assert out["losses"] == pytest.approx(ref["losses"], abs=1e-5)

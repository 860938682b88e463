"""In-place ops at a pipeline stage boundary ([Note: in-place ops at boundaries])."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from polytrain.testing import assert_state_close, run_job
from tests.conftest import small_job

pytestmark = pytest.mark.slow


def test_inplace_relu_at_a_stage_boundary_matches_single_process(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    data = tmp_path / "pairs.safetensors"
    save_file(
        {
            "inputs": torch.randn(64, 6, generator=g),
            "targets": torch.randint(0, 3, (64,), generator=g),
        },
        str(data),
    )
    sections = {
        "model": {"name": "tests.helpers.contract_models:inplace_relus"},
        "data": {"source": str(data)},
    }
    ref = run_job(small_job(**sections))
    out = run_job(
        small_job(
            **sections,
            parallel={"pp": 2},
            pipeline={"partition": [2, 4], "microbatches": 2},
            launch={"nproc": 2},
        )
    )
    assert_state_close(out["state"], ref["state"], atol=1e-5)

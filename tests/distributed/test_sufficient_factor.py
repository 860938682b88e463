"""Sufficient-factor exchange is exact: same weights as one process, bytes as the cost rule says."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from polytrain.testing import assert_state_close, run_distributed, run_job
from tests.conftest import small_job

pytestmark = pytest.mark.slow

GPT = {"name": "gpt", "n_layer": 2, "n_embd": 32, "n_head": 4, "block_size": 16}


def test_mlp_dp2_matches_single_process() -> None:
    ref = run_job(small_job())
    out = run_job(small_job(parallel={"sufficient_factor": "on"}, launch={"nproc": 2}))
    assert out["strategy"] == "ddp-dp2-sf3"  # both hidden layers and the output layer
    assert_state_close(out["state"], ref["state"], atol=1e-5)
    assert out["losses"] == pytest.approx(ref["losses"], abs=1e-5)


def test_gpt_dp4_with_accumulation_and_clipping_matches_single_process() -> None:
    """Token activations (B, T, n) flatten to B*T rows; 13 Linear layers exchange factors while
    embeddings and LayerNorms stay on DDP; two micro-steps per replica accumulate."""
    sections: dict[str, Any] = {"model": GPT, "optim": {"grad_clip": 0.5}}
    ref = run_job(small_job(**sections))
    out = run_job(
        small_job(
            **sections,
            parallel={"sufficient_factor": "on"},
            train={"grad_accum": 2},
            launch={"nproc": 4},
        )
    )
    assert out["strategy"] == "ddp-dp4-sf13"
    assert_state_close(out["state"], ref["state"], atol=1e-5)


ROWS = 4  # per rank


def _exchange_rank(rank: int, world: int) -> dict[str, Any]:
    from torch import nn

    from polytrain.comm.mesh import build_mesh
    from polytrain.comm.sufficient_factor import traffic
    from polytrain.config.job import ParallelConfig
    from polytrain.parallel.data_parallel import apply_data_parallel
    from polytrain.parallel.sufficient_factor import apply_sufficient_factor
    from polytrain.topology import ParallelDims

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))
    reference = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))
    reference.load_state_dict(model.state_dict())
    x = torch.randn(world * ROWS, 64, generator=torch.Generator().manual_seed(1))
    mesh = build_mesh(ParallelDims(dp=world))
    mine = x[rank * ROWS : (rank + 1) * ROWS]
    plan = apply_sufficient_factor(model, mesh, "auto", mine, ROWS)
    ddp = apply_data_parallel(model, mesh, ParallelConfig(dp=world))
    traffic.reset()
    ddp(mine).square().mean().backward()
    reference(x).square().mean().backward()
    return {
        "chosen": plan.chosen,
        "allreduce_params": plan.allreduce_params,
        "bytes": traffic.bytes_sent,
        "expected_bytes": sum(c.factor_bytes for c in plan.costs if c.name in plan.chosen),
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "ref_grads": {n: p.grad for n, p in reference.named_parameters()},
    }


@pytest.mark.parametrize("world", [2])
def test_auto_picks_the_wide_layer_and_counts_its_bytes(world: int) -> None:
    """64x64 with 4 rows: factors are cheaper; 64x2: the all-reduce is. Both end exact."""
    for out in run_distributed(_exchange_rank, world):
        assert out["chosen"] == ["0"]
        assert out["allreduce_params"] == ["2.weight", "2.bias"]
        assert out["bytes"] == out["expected_bytes"] == (world - 1) * ROWS * (64 + 64) * 4
        assert_state_close(out["grads"], out["ref_grads"], atol=1e-6)

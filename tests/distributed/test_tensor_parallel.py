"""Tensor parallel and dp x tp reproduce the single-process run parameter by parameter.

GPT runs on a 64-token vocabulary so the embedding is vocabulary-parallel and the output layer
column-parallel (64 divides by 2 and 4); the MLP runs on the default corpus (103 characters,
output layer row-parallel after an odd number of hidden layers) and on the 64-token data
(output column-parallel with gathered logits). Gradient clipping is on for GPT, so the norm of
the sharded gradients is checked too.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from polytrain.testing import assert_state_close, run_distributed, run_job
from tests.conftest import small_job

pytestmark = pytest.mark.slow

GPT = {"name": "gpt", "n_layer": 2, "n_embd": 32, "n_head": 4, "block_size": 16}


@cache
def tokens64() -> str:
    """A 1-D token array with a 64-id vocabulary (kept for the whole session)."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="polytrain-tp-")) / "tokens64.npy"
    ids = np.random.default_rng(0).integers(0, 64, 20_000)
    ids[0] = 63
    np.save(path, ids)
    return str(path)


def _gpt_job(**sections: dict[str, Any]) -> Any:
    return small_job(model=GPT, data={"source": tokens64()}, optim={"grad_clip": 0.5}, **sections)


def _mlp_job(n_layer: int, data: str, **sections: dict[str, Any]) -> Any:
    source = tokens64() if data == "tokens64" else "pydoc"
    return small_job(model={"name": "mlp", "n_layer": n_layer}, data={"source": source}, **sections)


@cache
def gpt_reference() -> dict[str, Any]:
    return run_job(_gpt_job())


@cache
def mlp_reference(n_layer: int, data: str) -> dict[str, Any]:
    return run_job(_mlp_job(n_layer, data))


def _check(out: dict[str, Any], ref: dict[str, Any]) -> None:
    assert_state_close(out["state"], ref["state"], atol=1e-5)
    assert out["losses"] == pytest.approx(ref["losses"], abs=1e-5)


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt_tp_matches_single_process(tp: int) -> None:
    out = run_job(_gpt_job(parallel={"tp": tp}, launch={"nproc": tp}))
    assert out["strategy"] == f"tp{tp}"
    _check(out, gpt_reference())


@pytest.mark.parametrize(
    ("tp", "n_layer", "data"),
    [(2, 3, "pydoc"), (4, 2, "tokens64")],
    ids=["tp2-rowwise-output", "tp4-gathered-output"],
)
def test_mlp_tp_matches_single_process(tp: int, n_layer: int, data: str) -> None:
    out = run_job(_mlp_job(n_layer, data, parallel={"tp": tp}, launch={"nproc": tp}))
    _check(out, mlp_reference(n_layer, data))


def test_gpt_dp2_tp2_with_recompute_and_accumulation() -> None:
    """Replicas over dp, shards over tp, recomputation between, two micro-steps per replica."""
    job = _gpt_job(
        parallel={"dp": 2, "tp": 2, "recompute": True},
        train={"grad_accum": 2},
        launch={"nproc": 4},
    )
    out = run_job(job)
    assert out["strategy"] == "replicate-dp2-tp2"
    _check(out, gpt_reference())


def test_mlp_zero2_dp2_tp2() -> None:
    """FSDP2 over dp on top of the tp shards (2-D parameters)."""
    job = _mlp_job(2, "tokens64", parallel={"dp": 2, "tp": 2, "zero": 2}, launch={"nproc": 4})
    out = run_job(job)
    assert out["strategy"] == "zero2-dp2-tp2"
    _check(out, mlp_reference(2, "tokens64"))


def test_gpt_dp2_tp2_pp2_world8() -> None:
    """The 3-D mesh: 2 pipeline stages (1F1B, 2 micro-batches), each split over 2 tp ranks,
    replicated over 2 dp ranks. Stage 0 holds the vocabulary-parallel embedding, stage 1 the
    gathered output layer; the global-norm clip sums tp shards and pipeline stages."""
    job = _gpt_job(
        parallel={"dp": 2, "tp": 2, "pp": 2},
        pipeline={"schedule": "1f1b", "microbatches": 2},
        launch={"nproc": 8},
    )
    out = run_job(job, timeout_s=300)
    assert out["strategy"] == "1f1b-pp2-m2-dp2-tp2"
    _check(out, gpt_reference())


def _reduced(rank: int, world_size: int) -> tuple[float, bool]:
    import torch

    from polytrain.comm.init import init_distributed
    from polytrain.data.datasets import build_datasets
    from polytrain.data.sampler import Batches
    from polytrain.models.registry import block_size_of, build_model
    from polytrain.parallel.family import build_spmd

    job = small_job(parallel={"dp": 2, "tp": 2}, launch={"nproc": 4})
    train_set, val_set, spec = build_datasets(job.data, block_size_of(job.model))
    batches = Batches(train_set, val_set, job.train.global_batch_size, job.train.seed)
    strategy = build_spmd(job, init_distributed(), build_model(job.model, spec, 1), batches)
    # replica 0 (ranks 0, 1) has loss 1, replica 1 (ranks 2, 3) loss 3; only rank 3 saw a NaN
    stats = torch.tensor([1.0 + 2 * (rank // 2), float(rank == 3)])
    return strategy.reduce(stats)


def test_dp2_tp2_averages_the_loss_and_flag_over_every_rank() -> None:
    """The end of step's [loss, non-finite flag] reduce spans dp and tp (one all-reduce over
    the world): one tensor-parallel rank's bad gradient shard stops every rank."""
    for loss, bad in run_distributed(_reduced, 4, timeout_s=120):
        assert loss == 2.0 and bad

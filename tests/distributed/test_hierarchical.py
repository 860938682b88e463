"""Hierarchical all-reduce (reduce in a host, all-reduce across hosts, broadcast back) as a DDP
hook: same gradients as DDP's flat all-reduce, and the trained weights of the one-process run.

Hosts are emulated by rank ranges (``ranks_per_host``), as the elastic launcher assigns them;
the emulated-network version is in benchmarks/multihost.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from polytrain.testing import assert_state_close, run_distributed, run_job
from tests.conftest import small_job

pytestmark = pytest.mark.slow


def _grads_both_ways(rank: int, world: int, mode: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from polytrain.comm.mesh import build_mesh
    from polytrain.config.job import ParallelConfig
    from polytrain.parallel.hierarchical import apply_hierarchical
    from polytrain.topology import ParallelDims

    mesh = build_mesh(ParallelDims(dp=world))
    grads = {}
    decision = ""
    for kind in ("flat", mode):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        ddp = DDP(model, process_group=mesh.group("dp"), bucket_cap_mb=0.0001)  # many buckets
        if kind != "flat":
            decision = apply_hierarchical(ddp, mesh, ParallelConfig(hierarchical=mode), per_host=2)
        torch.manual_seed(1 + rank)  # each rank its own data
        ddp(torch.randn(5, 8)).pow(2).sum().backward()
        grads[kind] = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"decision": decision, "flat": grads["flat"], "other": grads[mode]}


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_hook_gives_flat_all_reduce_gradients(mode: str) -> None:
    """Two emulated hosts of two ranks; ``on`` installs the hook; ``auto`` measures and
    either way gives the same averaged gradients on every rank."""
    results = run_distributed(_grads_both_ways, 4, mode)
    for out in results:
        if mode == "on":
            assert out["decision"] == "hierarchical", out["decision"]
        else:
            assert out["decision"].startswith(("hierarchical (", "flat (")), out["decision"]
        assert_state_close(out["other"], out["flat"], atol=1e-6)
        assert_state_close(out["flat"], results[0]["flat"], atol=0.0)  # all ranks agree


def test_one_rank_per_host_or_one_host_stays_flat() -> None:
    results = run_distributed(_one_host, 2)
    assert results == ["flat", "flat"]


def _one_host(rank: int, world: int) -> str:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from polytrain.comm.mesh import build_mesh
    from polytrain.config.job import ParallelConfig
    from polytrain.parallel.hierarchical import apply_hierarchical
    from polytrain.topology import ParallelDims

    mesh = build_mesh(ParallelDims(dp=world))
    ddp = DDP(nn.Linear(2, 2), process_group=mesh.group("dp"))
    one_host = apply_hierarchical(ddp, mesh, ParallelConfig(hierarchical="on"), per_host=world)
    one_per_host = apply_hierarchical(ddp, mesh, ParallelConfig(hierarchical="on"), per_host=1)
    return one_host if one_host == one_per_host else f"{one_host}/{one_per_host}"


def test_trainer_with_hook_matches_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """dp 4 over two emulated hosts (LOCAL_WORLD_SIZE=2) trains to the one-process weights."""
    ref = run_job(small_job())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # inherited by the spawned ranks
    out = run_job(small_job(parallel={"dp": 4, "hierarchical": "on"}, launch={"nproc": 4}))
    assert_state_close(out["state"], ref["state"], atol=1e-5)

"""torch's FSDP, DTensor and DCP stay unimported until a job uses them ([Note: lazy
torch.distributed] in polytrain/_lazy_dist.py), and the checks that stand in for
``isinstance`` answer as ``isinstance`` would."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from polytrain._lazy_dist import is_dtensor, is_fsdp_module, local_tensor
from polytrain.testing import run_distributed

HEAVY = ("torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint")

# A fresh interpreter: import what a worker (`python -m polytrain.trainer.worker`) and the
# launcher (`polytrain train`) import, then run a plain model through the end-of-step rules a
# data-parallel step runs (the DTensor checks of clipping, the non-finite flag, the norm, the
# state-byte count). A torch optimizer is not built: torch imports FSDP itself then (through
# torch._dynamo), which is torch's cost, not ours.
_PROBE = textwrap.dedent(
    """
    import sys

    import torch

    import polytrain.cli.app
    import polytrain.trainer.worker
    from polytrain._lazy_dist import is_dtensor, is_fsdp_module
    from polytrain.core.step import clip_gradients_, nonfinite_flag
    from polytrain.observe.metrics import model_state_bytes
    from polytrain.parallel.grad_norm import grad_norm

    model = torch.nn.Linear(4, 2)
    model(torch.ones(3, 4)).sum().backward()
    params = list(model.parameters())
    assert not is_dtensor(params[0]) and not is_fsdp_module(model)
    clip_gradients_(params, 1.0, grad_norm)
    clip_gradients_(params, 1.0)
    assert nonfinite_flag(params, torch.device("cpu")).item() == 0.0
    assert model_state_bytes([model], None)["params"] == 10 * 4
    print(sorted(package for package in {heavy!r} if package in sys.modules))
    """
)


@pytest.mark.slow  # a fresh interpreter
def test_worker_and_launcher_leave_fsdp_dtensor_and_dcp_unimported() -> None:
    src = Path(__file__).resolve().parents[2] / "src"
    done = subprocess.run(
        [sys.executable, "-c", _PROBE.format(heavy=HEAVY)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(src)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", f"imported at start-up: {done.stdout.strip()}"


def _isinstance_checks(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    local = torch.arange(4.0)
    dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    assert is_dtensor(dt) and not is_dtensor(local) and not is_dtensor(None)
    assert torch.equal(local_tensor(dt), local) and local_tensor(local) is local
    model = nn.Sequential(nn.Linear(2, 2))
    assert not is_fsdp_module(model)
    fully_shard(model, mesh=mesh)
    assert is_fsdp_module(model) and isinstance(model, FSDPModule)
    assert is_dtensor(next(model.parameters()))


@pytest.mark.slow  # a rank of the gloo harness (this process keeps no process group)
def test_checks_answer_as_isinstance_once_the_packages_are_loaded() -> None:
    run_distributed(_isinstance_checks, 1)

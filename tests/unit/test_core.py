"""core/: the one step contract, declared capabilities and the family table, in one process."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from polytrain.config.io import job_from_dict
from polytrain.core import (
    NonFiniteLossError,
    StepOutput,
    StepRules,
    Strategy,
    finish_step,
    mean_over,
)
from polytrain.errors import CheckpointError
from polytrain.observe.trace import Tracer
from polytrain.trainer.build import strategy_family
from polytrain.trainer.checkpoint import Checkpointer


def _model_with_grads(seed: int = 0, nan: bool = False) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    loss = (model(torch.randn(8, 4)) ** 2).mean() * 50  # large: clipping at 1.0 acts
    loss.backward()
    if nan:
        assert model.bias.grad is not None
        model.bias.grad[0] = float("nan")
    return model, loss.detach()


def test_finish_step_clips_and_steps_as_torch_does() -> None:
    model, loss = _model_with_grads()
    ref = copy.deepcopy(model)  # Parameter.__deepcopy__ leaves .grad behind
    for r, p in zip(ref.parameters(), model.parameters(), strict=True):
        assert p.grad is not None
        r.grad = p.grad.clone()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    ref_opt.step()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = finish_step(
        0, loss, model.parameters(), StepRules("stop", 1.0), reduce=mean_over(), optimizer=opt
    )
    assert out == StepOutput(loss=float(loss))
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def test_finish_step_skip_drops_the_update() -> None:
    model, loss = _model_with_grads(nan=True)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = finish_step(
        4, loss, model.parameters(), StepRules("skip", 1.0), reduce=mean_over(), optimizer=opt
    )
    assert out.skipped
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


def test_finish_step_stop_names_the_one_based_step() -> None:
    model, loss = _model_with_grads(nan=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteLossError, match=r"^a gradient is NaN/Inf \(loss .*\) at step 3:"):
        finish_step(
            2, loss, model.parameters(), StepRules("stop", 0.0), reduce=mean_over(), optimizer=opt
        )


def test_finish_step_runs_a_custom_update_or_drop() -> None:
    calls: list[str] = []
    for nan in (False, True):
        model, loss = _model_with_grads(nan=nan)
        finish_step(
            0,
            loss,
            model.parameters(),
            StepRules("skip", 0.0),
            reduce=mean_over(),
            update=lambda: calls.append("push"),
            drop=lambda: calls.append("poisoned push"),
        )
    assert calls == ["push", "poisoned push"]


class _Minimal(Strategy):
    def __init__(self) -> None:
        self.name, self.modules, self.tracer = "minimal", [], Tracer(0, enabled=False)
        self.optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)

    def train_step(self, step: int) -> StepOutput:
        return StepOutput(loss=0.0)

    def evaluate(self, num_batches: int) -> float:
        return 0.0

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {}


def test_capabilities_are_declared_with_defaults() -> None:
    s = _Minimal()
    assert s.checkpointable and s.world_collectives and s.evaluates
    assert s.checkpoint_group is None and s.checkpoint_refusal == ""
    s.resume_at(3)  # a no-op unless a strategy needs it
    s.before_save(3)  # likewise
    assert s.checkpoint_parts() == (s.modules, s.optimizer)  # what the checkpointer saves
    s.set_lr(0.25)
    assert s.optimizer is not None and s.optimizer.param_groups[0]["lr"] == 0.25


def test_checkpointer_refuses_with_the_strategys_declared_reason() -> None:
    s = _Minimal()
    s.checkpointable, s.checkpoint_refusal = False, "cannot: use another mode"
    job = job_from_dict({"checkpoint": {"dir": "/nonexistent/ckpt"}, "launch": {"nproc": 1}})
    with pytest.raises(CheckpointError, match="^cannot: use another mode$"):
        Checkpointer(job, s, 0, 1)


@pytest.mark.parametrize(
    ("parallel", "nproc", "family"),
    [
        ({}, 2, "spmd"),
        ({"zero": 3}, 2, "spmd"),
        ({"pp": 2}, 2, "pipeline"),
        ({"sync": "ps"}, 3, "parameter-server"),
    ],
)
def test_the_family_table_picks_one_family(
    parallel: dict[str, object], nproc: int, family: str
) -> None:
    job = job_from_dict({"parallel": parallel, "launch": {"nproc": nproc}})
    assert strategy_family(job).name == family

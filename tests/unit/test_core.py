"""core/: the one step contract, declared capabilities and the family table, in one process."""

from __future__ import annotations

import copy
import math

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
    step_result,
)
from polytrain.core.loss_scale import LossScale
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
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    ref_opt.step()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = finish_step(
        0, loss, model.parameters(), StepRules("stop", 1.0), reduce=mean_over(), optimizer=opt
    )
    assert out == StepOutput(loss=float(loss), metrics={"grad_norm": float(norm)})
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


# -- the step on the device ([Note: the step stays on the device]) ----------------------------


def _fused(model: nn.Module, name: str = "adamw") -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_fused_step_is_read_later_and_equals_the_host_step(name: str) -> None:
    model, loss = _model_with_grads()
    ref = copy.deepcopy(model)
    for r, p in zip(ref.parameters(), model.parameters(), strict=True):
        assert p.grad is not None
        r.grad = p.grad.clone()
    rules = StepRules("stop", 1.0)
    out = finish_step(
        0, loss, model.parameters(), rules, reduce=mean_over(), optimizer=_fused(model, name)
    )
    assert out.complete is not None and out.flag is not None and math.isnan(out.loss)
    result = step_result(out)
    ref_opt = _fused(ref, name)
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    ref_opt.step()
    # [Note: grad_norm]: the norm before clipping, read with the loss
    assert result == StepOutput(loss=float(loss), metrics={"grad_norm": pytest.approx(float(norm))})
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


@pytest.mark.parametrize("on_nonfinite", ["stop", "skip"])
def test_a_fused_nonfinite_step_applies_no_update_in_either_mode(on_nonfinite: str) -> None:
    model, loss = _model_with_grads(nan=True)
    before = [p.detach().clone() for p in model.parameters()]
    opt = _fused(model)
    out = finish_step(
        2,
        loss,
        model.parameters(),
        StepRules(on_nonfinite, 1.0),
        reduce=mean_over(),
        optimizer=opt,  # type: ignore[arg-type]
    )
    assert out.flag is not None and float(out.flag) == 1.0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
    assert all(float(s["step"]) == 0 for s in opt.state.values())  # the step count put back
    if on_nonfinite == "skip":
        assert step_result(out).skipped
    else:
        with pytest.raises(
            NonFiniteLossError, match=r"^a gradient is NaN/Inf \(loss .*\) at step 3:"
        ):
            step_result(out)


def test_fused_sgd_with_momentum_survives_a_skipped_first_step() -> None:
    """[Note: fused SGD's first step] in core/optim.py."""
    from polytrain.config.job import OptimConfig
    from polytrain.core.optim import build_optimizer

    model, loss = _model_with_grads(nan=True)
    cfg = OptimConfig(name="sgd", momentum=0.9, lr=0.1)
    opt = build_optimizer(model.parameters(), cfg)
    finish_step(
        0, loss, model.parameters(), StepRules("skip", 0.0), reduce=mean_over(), optimizer=opt
    )
    model.zero_grad()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in model.parameters()]
    out = finish_step(
        1, loss, model.parameters(), StepRules("skip", 0.0), reduce=mean_over(), optimizer=opt
    )
    assert not step_result(out).skipped
    for a, b in zip(model.parameters(), before, strict=True):  # the first real step: p - lr * g
        torch.testing.assert_close(a, b - 0.1)


def test_loss_scale_halves_on_overflow_and_grows_after_its_interval() -> None:
    scale = LossScale(torch.device("cpu"), init=8.0, interval=2)
    scale.update(torch.tensor(1.0))
    assert float(scale.factor) == 4.0
    scale.update(torch.tensor(0.0))
    scale.update(torch.tensor(0.0))
    assert float(scale.factor) == 8.0


def test_an_fp16_overflow_skips_the_step_even_under_stop() -> None:
    model, loss = _model_with_grads()
    scale = LossScale(torch.device("cpu"), init=4.0)
    for p in model.parameters():
        assert p.grad is not None
        p.grad.mul_(4.0)  # as backward from the scaled loss leaves them
    model.bias.grad[0] = float("inf")  # type: ignore[index]
    before = [p.detach().clone() for p in model.parameters()]
    out = finish_step(
        0,
        loss,
        model.parameters(),
        StepRules("stop", 1.0),
        reduce=mean_over(),
        optimizer=_fused(model),
        loss_scale=scale,
    )
    assert step_result(out).skipped and float(scale.factor) == 2.0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


def test_an_fp16_step_unscales_before_it_clips_and_steps() -> None:
    model, loss = _model_with_grads()
    ref = copy.deepcopy(model)
    for r, p in zip(ref.parameters(), model.parameters(), strict=True):
        assert p.grad is not None
        r.grad = p.grad.clone()
        p.grad.mul_(1024.0)
    scale = LossScale(torch.device("cpu"), init=1024.0)
    out = finish_step(
        0,
        loss,
        model.parameters(),
        StepRules("stop", 1.0),
        reduce=mean_over(),
        optimizer=_fused(model),
        loss_scale=scale,
    )
    assert not step_result(out).skipped
    ref_opt = _fused(ref)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


# -- results read when the loop logs ([Note: reading results late]) ---------------------------


def test_pending_results_read_in_order_and_stop_on_a_landed_flag() -> None:
    import contextlib

    from polytrain.trainer.results import PendingResults

    pending = PendingResults(torch.device("cpu"), stop=True)

    def out(value: float, bad: bool) -> StepOutput:
        def complete() -> StepOutput:
            if bad:
                raise NonFiniteLossError(f"loss is nan at step {int(value)}")
            return StepOutput(loss=value)

        return StepOutput(loss=math.nan, complete=complete, flag=torch.tensor(float(bad)))

    pending.add(0, out(1.0, False), 0.5)
    assert not pending.stop_seen()
    pending.add(1, out(2.0, False), 0.25)
    read = pending.read(lambda what: contextlib.nullcontext())
    assert [(r.step, r.out.loss, r.step_time_s) for r in read] == [(0, 1.0, 0.5), (1, 2.0, 0.25)]
    assert len(pending) == 0
    pending.add(2, out(3.0, True), 0.5)
    assert pending.stop_seen()
    with pytest.raises(NonFiniteLossError, match="step 3"):
        pending.read(lambda what: contextlib.nullcontext())

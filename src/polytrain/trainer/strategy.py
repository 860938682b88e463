"""The interface between the training loop and a parallel strategy, and the SPMD strategy.

A strategy owns its model shards and optimizer. The loop only asks it to run step ``t`` (it
fetches its own slice of the global batch, contract 1), to evaluate, and to hand back the full
weights. SPMD covers a plain model, DDP, FSDP2 and tensor parallelism, which all run the same
forward/backward on every rank and differ only in how the module was wrapped.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from polytrain.comm.collectives import all_reduce_mean
from polytrain.comm.mesh import Mesh
from polytrain.config.job import JobConfig
from polytrain.data.sampler import Batches
from polytrain.errors import PolytrainError
from polytrain.models.base import BlockModel, inputs_to
from polytrain.observe.trace import Tracer
from polytrain.parallel.grad_norm import clip_grad_norm_
from polytrain.trainer.health import nonfinite_flag
from polytrain.trainer.optim import build_optimizer

__all__ = ["NonFiniteLossError", "SPMDStrategy", "StepOutput", "Strategy", "step_result"]


class NonFiniteLossError(PolytrainError):
    """The loss became NaN or Inf and ``train.on_nonfinite = 'stop'``."""


@dataclass(frozen=True)
class StepOutput:
    """What one training step reports.

    [Note: deferred step results] A strategy whose ranks run out of step with each other
    (PipeDream's stream has no flush) would lose its overlap to a world collective that ends
    every step. It may return ``loss = nan`` and ``complete``: a function that waits for the
    step's reduction (started without blocking) and returns the final output. The loop calls
    ``complete`` after it has started the next step, or at once before an evaluation, a
    checkpoint or the last step; a non-finite stop is then raised one step later, naming the
    step it belongs to.
    """

    loss: float  # mean loss over the global batch (the same value on every rank)
    skipped: bool = False
    metrics: dict[str, float] = field(default_factory=dict)  # extra fields for the record
    complete: Callable[[], StepOutput] | None = None


def step_result(out: StepOutput) -> StepOutput:
    """``out`` with its deferred part waited for ([Note: deferred step results])."""
    return out.complete() if out.complete is not None else out


class Strategy(Protocol):
    """What the loop needs from a parallel strategy.

    ``modules`` are this rank's model parts whose ``state_dict`` keys are the unwrapped model's
    (``blocks.<i>...``), and ``optimizer`` updates exactly their parameters; checkpoints use
    both. ``tracer`` records this rank's spans for ``--trace`` (disabled when not asked for).
    """

    @property
    def name(self) -> str: ...

    @property
    def modules(self) -> list[nn.Module]: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer | None: ...

    @property
    def tracer(self) -> Tracer: ...

    def train_step(self, step: int) -> StepOutput: ...

    def set_lr(self, lr: float) -> None: ...

    def evaluate(self, num_batches: int) -> float: ...

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every rank calls it; rank 0 gets the unwrapped model's full weights."""
        ...


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager[None]:
    if dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class SPMDStrategy:
    """Every rank runs the whole (possibly wrapped or sharded) model on its data slice."""

    def __init__(
        self,
        job: JobConfig,
        model: nn.Module,
        base: BlockModel,
        mesh: Mesh,
        batches: Batches,
        device: torch.device,
        name: str,
    ) -> None:
        self.job, self.model, self.base, self.mesh = job, model, base, mesh
        self.batches, self.device, self.name = batches, device, name
        self.dp = mesh.dims.dp
        self.dp_rank = mesh.coord("dp")
        self.optimizer = build_optimizer(model.parameters(), job.optim)
        self.modules = [model]
        self.tracer = Tracer(mesh.rank, enabled=bool(job.observe.trace))

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _sync_context(self, last: bool) -> contextlib.AbstractContextManager[None]:
        """Skip the gradient all-reduce on every micro-step but the last (accumulation)."""
        if isinstance(self.model, DDP) and not last:
            return self.model.no_sync()
        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def train_step(self, step: int) -> StepOutput:
        accum = self.job.train.grad_accum
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for micro in range(accum):
            x, y = self.batches.train(step, self.dp_rank, self.dp, micro, accum)
            x, y = inputs_to(x, self.device), y.to(self.device)
            with self._sync_context(micro == accum - 1):
                with self.tracer.span("forward", microbatch=micro, step=step):
                    with autocast(self.device, self.job.train.dtype):
                        loss = self.base.loss(self.model(x), y) / accum
                with self.tracer.span("backward", microbatch=micro, step=step):
                    loss.backward()
            total += loss.detach()
        # The loss and a NaN/Inf-gradient flag share the one all-reduce (issue 6).
        stats = torch.stack([total, nonfinite_flag(self.model.parameters(), self.device)])
        all_reduce_mean(stats, self.mesh.group("dp"))
        if self.mesh.dims.tp > 1:  # tensor-parallel peers hold different gradient shards
            all_reduce_mean(stats, self.mesh.group("tp"))
        value, bad_grad = float(stats[0]), float(stats[1]) > 0
        if not math.isfinite(value) or bad_grad:
            return self._nonfinite(step, value, bad_grad)
        if self.job.optim.grad_clip > 0:
            clip_grad_norm_(self.model.parameters(), self.job.optim.grad_clip)
        self.optimizer.step()
        return StepOutput(loss=value)

    def _nonfinite(self, step: int, value: float, bad_grad: bool = False) -> StepOutput:
        # Every rank holds the same all-reduced loss and flag, so every rank takes the same branch.
        self.optimizer.zero_grad(set_to_none=True)
        if self.job.train.on_nonfinite == "skip":
            return StepOutput(loss=value, skipped=True)
        what = f"loss is {value}"
        if bad_grad and math.isfinite(value):
            what = f"a gradient is NaN/Inf (loss {value:.4g})"
        raise NonFiniteLossError(
            f"{what} at step {step + 1}: lower optim.lr, enable optim.grad_clip, or set "
            "train.on_nonfinite = 'skip'"
        )

    @torch.no_grad()
    def evaluate(self, num_batches: int) -> float:
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for i in range(num_batches):
            x, y = self.batches.val(i, self.dp_rank, self.dp)
            with autocast(self.device, self.job.train.dtype):
                total += self.base.loss(self.model(inputs_to(x, self.device)), y.to(self.device))
        return float(all_reduce_mean(total, self.mesh.group("dp"))) / num_batches

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self.model)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unwrapped, unsharded weights on CPU (complete on rank 0), with the plain model's keys."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    return {
        k: v.detach().cpu().contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)
    }

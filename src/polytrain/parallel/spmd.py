"""`SPMDStrategy`: every rank runs the whole (possibly wrapped or sharded) model on its data.

SPMD covers a plain model, DDP, FSDP2 and tensor parallelism, which all run the same
forward/backward on every rank and differ only in how the module was wrapped (`build_spmd`,
in the order of STYLE 3). The step ends through `polytrain.core.finish_step` ([Note: one step
contract]): loss and NaN/Inf flag averaged over ``dp`` (then ``tp``, whose peers hold different
gradient shards) in one collective, clipping by the global norm of mixed DTensor and plain
gradients (`parallel.grad_norm`), then the optimizer step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Literal

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from polytrain._lazy_dist import is_fsdp_module
from polytrain.comm.collectives import all_reduce_sum_
from polytrain.comm.compression import SentBytes
from polytrain.comm.mesh import Mesh
from polytrain.config.job import JobConfig
from polytrain.core.loss_scale import backward, loss_scale_of
from polytrain.core.microbatch import forward_backward
from polytrain.core.modules import train_mode
from polytrain.core.optim import build_optimizer
from polytrain.core.step import StepRules, autocast, finish_step, mean_over
from polytrain.core.strategy import StepOutput, Strategy
from polytrain.data.sampler import Batches
from polytrain.models.base import BlockModel, Inputs, inputs_to
from polytrain.models.contract import top1_correct
from polytrain.observe.trace import Tracer
from polytrain.parallel.grad_norm import grad_norm

__all__ = ["SPMDStrategy", "full_state_dict"]


class SPMDStrategy(Strategy):
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
        self.optimizer: torch.optim.Optimizer = build_optimizer(model.parameters(), job.optim)
        # Walked once: the parameters are final once the model is wrapped (FSDP2 and tensor
        # parallelism replace them before this), and a walk per step costs host time.
        self.params = list(model.parameters())
        self.modules = [model]
        self.tracer = Tracer(mesh.rank, enabled=bool(job.observe.trace))
        self.rules = StepRules.of(job)
        self.loss_scale = loss_scale_of(job.train.dtype, device)
        # [loss, non-finite flag] averaged over every rank in ONE all-reduce: the mesh is the
        # world (pp = 1); tensor-parallel peers hold the same loss and different gradient
        # shards, whose flags count too. Over dp and then over tp was two in a row (dp2 x tp2
        # on the 2-core VM: 3.8-4.2 ms of a 56 ms mlp step, 2026-11-26).
        self.reduce = mean_over(None)
        self._accuracy: float | None = None  # of the last evaluation, on classification data
        # What each rank reads of a step's batch: "replica", its slice (inputs and targets);
        # "gather", its slice of the inputs and every slice's targets (hybrid parallelism: the
        # output covers the whole batch, [Note: hybrid activation redistribution]); "whole",
        # the whole batch (spatial parallelism: each rank then keeps its band of image rows).
        self.batch: Literal["replica", "gather", "whole"] = "replica"
        # Set where our DDP compression hook counts the bytes it hands to c10d: each step's
        # record then carries them as ``bytes_sent``.
        self.sent: SentBytes | None = None

    def _batch(
        self, get: Callable[[int, int], tuple[Inputs, torch.Tensor]]
    ) -> tuple[Inputs, torch.Tensor]:
        """``get(replica, num_replicas)`` as `batch` says."""
        if self.batch == "whole":
            return get(0, 1)
        x, y = get(self.dp_rank, self.dp)
        if self.batch == "gather":
            y = torch.cat([y if r == self.dp_rank else get(r, self.dp)[1] for r in range(self.dp)])
        return x, y

    def _sync_context(self, last: bool) -> contextlib.AbstractContextManager[None]:
        """Skip the gradient all-reduce on every micro-step but the last (accumulation)."""
        if isinstance(self.model, DDP) and not last:
            return self.model.no_sync()
        if is_fsdp_module(self.model):
            self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def train_step(self, step: int) -> StepOutput:
        accum = self.job.train.grad_accum
        train_mode(self.model)
        self.optimizer.zero_grad(set_to_none=True)
        total = forward_backward(
            self.model,
            self.base.loss,
            lambda micro: self._batch(
                partial(self.batches.train, step, microbatch=micro, num_microbatches=accum)
            ),
            step=step,
            num_microbatches=accum,
            device=self.device,
            dtype=self.job.train.dtype,
            tracer=self.tracer,
            backward=partial(backward, scale=self.loss_scale),
            around=self._sync_context,
        )
        out = finish_step(
            step,
            total,
            self.params,
            self.rules,
            reduce=self.reduce,
            optimizer=self.optimizer,
            grad_norm=grad_norm,
            loss_scale=self.loss_scale,
        )
        if self.sent is None:
            return out
        return replace(out, metrics={**out.metrics, "bytes_sent": float(self.sent.take())})

    @torch.no_grad()
    def evaluate(self, num_batches: int) -> float:
        """Mean validation loss; on classification data also top-1 accuracy (every replica's
        rows counted once: correct and seen rows are summed over ``dp`` with the loss)."""
        self.model.eval()
        total = torch.zeros((), device=self.device)
        counts = torch.zeros(2, device=self.device)  # [correct, rows]; rows stay 0 if no classes
        for i in range(num_batches):
            x, y = self._batch(partial(self.batches.val, i))
            y = y.to(self.device)
            with autocast(self.device, self.job.train.dtype):
                output = self.model(inputs_to(x, self.device))
                total += self.base.loss(output, y)
            correct = top1_correct(output, y)
            if correct is not None:
                counts += torch.stack([correct, torch.tensor(float(len(y)), device=self.device)])
        # Every rank's loss and counts are summed: with "gather" or "whole" each holds the
        # whole batch's, so the loss is divided by dp and the counts' ratio is unchanged.
        sums = all_reduce_sum_(
            torch.cat([total.reshape(1) / self.dp, counts]), self.mesh.group("dp")
        )
        self._accuracy = float(sums[1] / sums[2]) if float(sums[2]) else None
        return float(sums[0]) / num_batches

    def evaluation_metrics(self) -> dict[str, float]:
        return {} if self._accuracy is None else {"val_accuracy": self._accuracy}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self.model)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unwrapped, unsharded weights on CPU (complete on rank 0), with the plain model's keys."""
    # Imported here, not at the top: [Note: lazy torch.distributed] in _lazy_dist.py.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    return {
        k: v.detach().cpu().contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)
    }

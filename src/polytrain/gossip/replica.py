"""`ReplicaStrategy`: every rank trains its own full replica; subclasses say how replicas meet.

The common half of gossip and local SGD. A step is a local step on this rank's slice of the
global batch (contract 1), ended through `polytrain.core.finish_step` ([Note: one step
contract]) whose update is the local optimizer step followed by the subclass's `communicate`
(mix with neighbours, or average every H steps).

[Note: the average model] Replicas differ between synchronizations, so what the job *is* at a
given step is their average, ``sum_i w_i x_i / sum_i w_i`` (push-sum weights ``w_i``; 1 without
push-sum). Evaluation, the exported weights (`full_state_dict`) and the consensus distance all
use it. At a checkpoint step the replicas (and their optimizer states) are replaced by their
exact average before the checkpointer runs, so every rank holds the same state, one copy is
saved, and a resumed run continues from the average on every replica. This adds one world
all-reduce of the model per checkpoint, and a resumed run equals the uninterrupted one.

[Note: replica step rules] The loss and NaN/Inf flag are still averaged over the world (two
floats per step) so every rank takes the same non-finite branch and logs the job's loss.
Gradient clipping is per replica (each clips its own gradient by its own norm): there is no
global gradient to take a norm of.
"""

from __future__ import annotations

import time
from abc import abstractmethod

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from polytrain.comm.collectives import all_reduce_mean, all_reduce_mean_flat_
from polytrain.comm.gossip_wire import weighted_average
from polytrain.config.job import JobConfig
from polytrain.core.cadence import checkpoint_due
from polytrain.core.microbatch import forward_backward
from polytrain.core.modules import train_mode
from polytrain.core.optim import build_optimizer
from polytrain.core.step import StepRules, autocast, finish_step, mean_over
from polytrain.core.strategy import StepOutput, Strategy
from polytrain.data.sampler import Batches
from polytrain.models.base import BlockModel, inputs_to
from polytrain.observe.trace import Tracer

__all__ = ["ReplicaStrategy"]


class ReplicaStrategy(Strategy):
    """A full model replica per rank; `communicate` runs after each local optimizer step."""

    def __init__(
        self,
        job: JobConfig,
        model: BlockModel,
        batches: Batches,
        device: torch.device,
        rank: int,
        world_size: int,
    ) -> None:
        self.job, self.model, self.batches, self.device = job, model, batches, device
        self.rank, self.world_size = rank, world_size
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer: torch.optim.Optimizer = build_optimizer(self.params, job.optim)
        self.modules: list[nn.Module] = [model]
        self.tracer = Tracer(rank, enabled=bool(job.observe.trace))
        self.rules = StepRules.of(job)
        self.reduce = mean_over(None)  # the world ([Note: replica step rules])
        self.weight = 1.0  # push-sum weight of this replica ([Note: the average model])
        self.bytes_sent = 0  # bytes handed to c10d by `communicate` in this step
        self.straggler = rank == world_size - 1 and job.gossip.straggler_delay_s > 0

    @abstractmethod
    def communicate(self, step: int) -> None:
        """After the local optimizer step of ``step``: meet the other replicas (adds to
        ``bytes_sent``)."""

    def extra_metrics(self, step: int) -> dict[str, float]:
        """Fields a subclass adds to the step's record."""
        return {}

    def before_local_step(self) -> None:  # an optional hook
        """Called just before the local optimizer step (the parameters are still the old ones)."""

    def _update(self, step: int) -> None:
        if self.straggler:  # fault injection: a slow worker (gossip.straggler_delay_s)
            time.sleep(self.job.gossip.straggler_delay_s)
        self.before_local_step()
        self.optimizer.step()
        with self.tracer.span("communicate", cat="comm", step=step):
            self.communicate(step)

    def train_step(self, step: int) -> StepOutput:
        accum = self.job.train.grad_accum
        train_mode(self.model)
        self.optimizer.zero_grad(set_to_none=True)
        self.bytes_sent = 0
        total = forward_backward(
            self.model,
            self.model.loss,
            lambda micro: self.batches.train(step, self.rank, self.world_size, micro, accum),
            step=step,
            num_microbatches=accum,
            device=self.device,
            dtype=self.job.train.dtype,
            tracer=self.tracer,
        )
        out = finish_step(
            step,
            total,
            self.params,
            self.rules,
            reduce=self.reduce,
            optimizer=self.optimizer,
            update=lambda: self._update(step),
            tracer=self.tracer,
        )
        metrics = {"bytes_sent": float(self.bytes_sent), **self.extra_metrics(step)}
        last = step + 1 == self.job.train.steps
        if last or (step + 1) % self.job.observe.log_every == 0:
            metrics["consensus_distance"] = self.consensus_distance()
        if checkpoint_due(self.job, step + 1):  # the checkpointer saves the average
            self.synchronize()
        return StepOutput(loss=out.loss, skipped=out.skipped, metrics=metrics)

    # -- the average model ([Note: the average model]) -------------------------------------

    @torch.no_grad()
    def average_vector(self) -> torch.Tensor:
        """Collective: the network's average of the flat parameters."""
        return weighted_average(parameters_to_vector(self.params), self.weight)

    @torch.no_grad()
    def consensus_distance(self) -> float:
        """Collective: the mean over replicas of ``||x_i - x_avg||`` (L2, whole model)."""
        local = parameters_to_vector(self.params)
        distance = (local - self.average_vector()).norm().reshape(1)
        return float(all_reduce_mean(distance))

    def settle(self) -> None:  # an optional hook
        """Complete any exchange still in flight into this replica (overlapped gossip), before
        the replicas are averaged or exported."""

    @torch.no_grad()
    def synchronize(self) -> None:
        """Collective: every replica and optimizer state becomes the exact average."""
        self.settle()
        vector_to_parameters(self.average_vector(), self.params)
        self.weight = 1.0
        state = [
            t
            for s in self.optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor) and t.is_floating_point()
        ]
        all_reduce_mean_flat_(state)
        self.after_synchronize()

    def after_synchronize(self) -> None:  # an optional hook
        """Called once the replicas equal their average (a subclass resets its own state)."""

    @torch.no_grad()
    def _with_average(self) -> torch.Tensor:
        """Swap the average into the model; returns this replica's own vector to restore."""
        own = parameters_to_vector(self.params)
        vector_to_parameters(self.average_vector(), self.params)
        return own

    @torch.no_grad()
    def val_total(self, num_batches: int, rank: int, world_size: int) -> torch.Tensor:
        """This replica's summed validation loss on slice ``rank`` of ``world_size``."""
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for i in range(num_batches):
            x, y = self.batches.val(i, rank, world_size)
            with autocast(self.device, self.job.train.dtype):
                out = self.model(inputs_to(x, self.device))
                total += self.model.loss(out, y.to(self.device))
        return total

    @torch.no_grad()
    def evaluate(self, num_batches: int) -> float:
        own = self._with_average()
        try:
            total = self.val_total(num_batches, self.rank, self.world_size)
            return float(all_reduce_mean(total)) / num_batches
        finally:
            vector_to_parameters(own, self.params)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        self.settle()
        own = self._with_average()
        try:
            return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        finally:
            vector_to_parameters(own, self.params)

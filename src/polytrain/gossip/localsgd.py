"""``sync = "localsgd"``: periodic model averaging, hierarchical averaging, DiLoCo's outer step.

Local SGD (Stich, "Local SGD Converges Fast and Communicates Little", ICLR 2019; Lin et al.,
"Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020): every replica takes ``H`` local steps,
then all replicas are averaged. The averaging is torch's: `PeriodicModelAverager`, or
`HierarchicalModelAverager` with ``{1: ranks per host, H: world}`` (average inside a host every
step, across hosts every ``H``). DiLoCo (Douillard et al., 2023) treats the averaged change
since the last world average as a pseudo-gradient of an outer SGD with Nesterov momentum.

[Note: compressed averaging] With ``gossip.compress`` the world average is ours, not torch's
(its averagers send fp32): every replica compresses its change since the last average,
``x_i - a`` (``a``, the last average, is the same on every rank), with error feedback
(`polytrain.comm.compressors.ErrorFeedback`: what a message left out is added to the next
one); fp16/bf16 changes are summed by an all-reduce, top-k and sign messages (fixed sizes) are
all-gathered and decoded by every rank, and every replica becomes ``a + mean_i C(x_i - a)``,
the same on all ranks. A checkpoint's `synchronize` resets the residuals to zero (on every
rank, in the uninterrupted and the resumed run alike).

[Note: DiLoCo state] The anchor (the model after the last outer step) and the outer
momentum are the same on every rank (every rank takes the same outer step on the same average).
They are exposed to the checkpointer as a second module of ``modules`` (`module_of`: the anchor
as parameters ``diloco.anchor.<name>``, the momentum buffers, pre-created as SGD's
``momentum_buffer`` state, as buffers ``diloco.outer_momentum.<name>``), saved next to the
model and loaded in place. A checkpoint's `synchronize` averages the replicas but leaves them
alone, so the next world average's outer gradient is still ``anchor - average``, in the
uninterrupted and the resumed run alike.

[Note: averager step] torch's averagers count their own calls and average when the count is a
multiple of the period; we set ``averager.step = t + 1`` before each call (``t`` the 0-based
step), so the world average follows steps ``H, 2H, ...`` and a resumed run keeps the phase.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import torch
from torch.distributed.algorithms.model_averaging.averagers import (
    ModelAverager,
    PeriodicModelAverager,
)
from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
    HierarchicalModelAverager,
)
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from polytrain.comm.collectives import all_reduce_sum_
from polytrain.comm.compressors import CastCompressor, ErrorFeedback, build_compressor
from polytrain.comm.gossip_wire import all_gather_equal, nbytes
from polytrain.config.job import JobConfig
from polytrain.core.modules import module_of
from polytrain.data.sampler import Batches
from polytrain.gossip.replica import ReplicaStrategy
from polytrain.models.base import BlockModel

__all__ = ["LocalSGDStrategy"]


class LocalSGDStrategy(ReplicaStrategy):
    """Local steps; every ``H`` (and, hierarchically, inside a host every step) an average."""

    def __init__(
        self,
        job: JobConfig,
        model: BlockModel,
        batches: Batches,
        device: torch.device,
        rank: int,
        world_size: int,
    ) -> None:
        super().__init__(job, model, batches, device, rank, world_size)
        cfg = job.localsgd
        self.period = cfg.period
        self.per_host = (cfg.ranks_per_host or job.launch.num_procs) if cfg.hierarchical else 0
        self.name = f"localsgd-h{cfg.period}-w{world_size}"
        # torch warns that period 1 is better served by DDP; period 1 is our parity check.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.averager: ModelAverager
            if self.per_host and cfg.period > 1:
                self.name += f"-host{self.per_host}"
                sizes = OrderedDict([(1, self.per_host), (cfg.period, world_size)])
                self.averager = HierarchicalModelAverager(sizes)  # collective: makes subgroups
            else:
                self.averager = PeriodicModelAverager(cfg.period)
        self.model_bytes = sum(nbytes(p) for p in self.params)
        self.feedback: ErrorFeedback | None = None
        if job.gossip.compress != "none":  # [Note: compressed averaging]
            self.name += f"-{job.gossip.compress}"
            segments = [p.numel() for p in self.params]
            compressor = build_compressor(job.gossip.compress, segments, job.gossip.topk_ratio)
            self.feedback = ErrorFeedback(compressor, sum(segments))
            self.last_average = parameters_to_vector(self.params).detach().float().clone()
        self.outer: torch.optim.Optimizer | None = None
        if cfg.outer == "nesterov":
            self.name += "-diloco"
            self._build_outer(model)

    def _build_outer(self, model: BlockModel) -> None:
        """DiLoCo's outer optimizer and its state as a module the checkpoint saves ([Note:
        DiLoCo state])."""
        cfg = self.job.localsgd
        self.anchor = [torch.nn.Parameter(p.detach().clone()) for p in self.params]
        self.outer = torch.optim.SGD(
            self.anchor, lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True
        )
        state: dict[str, torch.Tensor] = {}
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        for name, anchor in zip(names, self.anchor, strict=True):
            momentum = torch.zeros_like(anchor.detach())
            # A zero buffer is what SGD's first step would start from (dampening 0): its first
            # step sets it to the gradient, as the clone it would make does.
            self.outer.state[anchor]["momentum_buffer"] = momentum
            state[f"diloco.anchor.{name}"] = anchor
            state[f"diloco.outer_momentum.{name}"] = momentum
        self.modules = [model, module_of(state)]

    def _world_round(self, step: int) -> bool:
        return (step + 1) % self.period == 0

    @torch.no_grad()
    def communicate(self, step: int) -> None:
        world_round = self._world_round(step)
        if not (world_round or self.per_host):
            self.averager.step = step + 1  # [Note: averager step]
            return
        self.averager.step = step + 1
        if self.feedback is not None:
            self._compressed_average()
        else:
            self.averager.average_parameters(iter(self.params))
            # torch's averager all-reduces one flat copy of the parameters
            # (utils.average_parameters).
            self.bytes_sent += self.model_bytes
        if world_round and self.outer is not None:
            self._outer_step()

    def _compressed_average(self) -> None:
        """[Note: compressed averaging]."""
        assert self.feedback is not None
        z = parameters_to_vector(self.params)
        packet, _ = self.feedback.compress(z.detach().float() - self.last_average)
        compressor = self.feedback.compressor
        if isinstance(compressor, CastCompressor):
            total = packet.tensors[0]
            all_reduce_sum_(total)
            self.bytes_sent += nbytes(total)
            mean = total.float() / self.world_size
        else:
            gathered, sent = all_gather_equal(packet.to_bytes())
            self.bytes_sent += sent
            decoded = [compressor.decode(packet.like(b)) for b in gathered]
            mean = torch.stack(decoded).mean(dim=0)
        self.last_average = self.last_average + mean
        # A copy: vector_to_parameters makes the parameters views of the vector it is given.
        vector_to_parameters(self.last_average.to(z.dtype, copy=True), self.params)

    def _outer_step(self) -> None:
        """DiLoCo: the averaged delta since the last world average is the outer gradient."""
        for a, p in zip(self.anchor, self.params, strict=True):
            a.grad = a.detach() - p.detach()
        assert self.outer is not None
        self.outer.step()
        for a, p in zip(self.anchor, self.params, strict=True):
            p.copy_(a.detach())

    def after_synchronize(self) -> None:
        if self.feedback is not None:
            self.feedback.residual.zero_()
            self.last_average = parameters_to_vector(self.params).detach().float().clone()

"""The layout-invariant global-batch sampler (ARCHITECTURE contract 1).

The global batch of step ``t`` is a function of ``(seed, t)`` alone. A data-parallel replica
``r`` of ``R`` takes rows ``[r*B/R, (r+1)*B/R)`` of it, and micro-batch ``j`` of ``M`` takes the
``j``-th equal slice of that. Any layout therefore sees the same samples in the same step, and
the data position of a run is just its step counter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polytrain.data.datasets import Dataset, Inputs

__all__ = ["Batches", "GlobalBatchSampler"]


@dataclass(frozen=True)
class GlobalBatchSampler:
    num_samples: int
    global_batch_size: int
    seed: int

    def indices(self, step: int) -> torch.Tensor:
        """Sample indices of the whole global batch of ``step``, shape (B,)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(0, self.num_samples, (self.global_batch_size,), generator=g)

    def shard(
        self,
        step: int,
        replica: int = 0,
        num_replicas: int = 1,
        microbatch: int = 0,
        num_microbatches: int = 1,
    ) -> torch.Tensor:
        """The indices of one replica's micro-batch of ``step``."""
        per_replica = self.global_batch_size // num_replicas
        per_micro = per_replica // num_microbatches
        start = replica * per_replica + microbatch * per_micro
        return self.indices(step)[start : start + per_micro]


class Batches:
    """Train and validation batches for one job, sliced by replica and micro-batch."""

    def __init__(self, train: Dataset, val: Dataset, global_batch_size: int, seed: int) -> None:
        self.train_set, self.val_set = train, val
        self.train_sampler = GlobalBatchSampler(len(train), global_batch_size, seed)
        # Validation uses its own stream so evaluating never shifts the training order.
        self.val_sampler = GlobalBatchSampler(len(val), global_batch_size, seed + 7919)

    def train(
        self,
        step: int,
        replica: int = 0,
        num_replicas: int = 1,
        microbatch: int = 0,
        num_microbatches: int = 1,
    ) -> tuple[Inputs, torch.Tensor]:
        idx = self.train_sampler.shard(step, replica, num_replicas, microbatch, num_microbatches)
        return self.train_set.get(idx)

    def val(
        self, index: int, replica: int = 0, num_replicas: int = 1
    ) -> tuple[Inputs, torch.Tensor]:
        return self.val_set.get(self.val_sampler.shard(index, replica, num_replicas))

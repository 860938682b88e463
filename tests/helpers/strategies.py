"""A job's strategy built in a rank as the training loop builds it, for tests that drive it."""

from __future__ import annotations

from polytrain.comm.init import DistContext
from polytrain.config import JobConfig
from polytrain.core.strategy import Strategy
from polytrain.data.datasets import build_datasets
from polytrain.data.sampler import Batches
from polytrain.models.registry import block_size_of, build_model
from polytrain.trainer.build import build_strategy


def job_strategy(job: JobConfig, ctx: DistContext) -> Strategy:
    """``job``'s data, model and strategy on this rank (no checkpoint, no loop)."""
    train_set, val_set, spec = build_datasets(job.data, block_size_of(job.model))
    batches = Batches(train_set, val_set, job.train.global_batch_size, job.train.seed)
    model = build_model(job.model, spec, job.train.seed)
    return build_strategy(job, ctx, model, batches)

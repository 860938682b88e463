"""When a step does more than train: the checkpoint-due rule, one home for the trainer's
checkpointer and for strategies that prepare a checkpoint inside their step (gossip averages
its replicas before one is saved)."""

from __future__ import annotations

from polytrain.config.job import JobConfig

__all__ = ["checkpoint_due"]


def checkpoint_due(job: JobConfig, done: int) -> bool:
    """Whether a checkpoint is saved after ``done`` optimizer steps: every
    ``checkpoint.every``, and always after the last; never without ``checkpoint.dir``."""
    c = job.checkpoint
    if not c.dir:
        return False
    return done == job.train.steps or bool(c.every and done % c.every == 0)

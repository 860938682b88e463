"""Run a whole `JobConfig` on harness ranks and bring rank 0's result back."""

from __future__ import annotations

from typing import Any

from polytrain.config.job import JobConfig
from polytrain.testing.harness import run_distributed
from polytrain.trainer.loop import train

__all__ = ["run_job"]


def _train_rank(rank: int, world_size: int, job: JobConfig) -> dict[str, Any] | None:
    result = train(job)
    if rank != 0:
        return None
    return {
        "state": result.state_dict,
        "losses": [r["loss"] for r in result.history],
        "val_loss": result.val_loss,
        "strategy": result.strategy,
        "history": result.history,
        "start": result.start_step,
    }


def run_job(job: JobConfig, *, timeout_s: float = 180.0) -> dict[str, Any]:
    """Train ``job`` on ``job.world_size`` gloo ranks; rank 0's result as a dict: ``state``
    (full weights), ``losses``, ``val_loss``, ``strategy``, ``history`` (the metric records)
    and ``start`` (the step it resumed from)."""
    results = run_distributed(_train_rank, job.world_size, job, timeout_s=timeout_s)
    out = results[0]
    assert out is not None
    return out

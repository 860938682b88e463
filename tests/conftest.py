"""Shared fixtures: small jobs that run in seconds on 2 cores."""

from __future__ import annotations

from typing import Any

import pytest

from polytrain.config import JobConfig, job_from_dict


def small_job(**sections: dict[str, Any]) -> JobConfig:
    """A job small enough for a multi-process test: few steps, small batch, no output."""
    data: dict[str, Any] = {
        "model": {"name": "mlp", "size": "tiny"},
        "train": {
            "steps": 4,
            "global_batch_size": 16,
            "seed": 1,
            "eval_every": 0,
            "eval_batches": 1,
            "sample_tokens": 0,
        },
        "optim": {
            "name": "sgd",
            "lr": 0.05,
            "momentum": 0.9,
            "schedule": "constant",
            "warmup_steps": 0,
            "grad_clip": 0.0,
        },
        "observe": {"progress": False},
        "launch": {"nproc": 1},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return job_from_dict(data)


@pytest.fixture
def job_factory() -> Any:
    return small_job

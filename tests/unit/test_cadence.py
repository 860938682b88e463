"""The checkpoint-due rule (`core.cadence`), shared by the checkpointer and gossip's step."""

from __future__ import annotations

from polytrain.config.job import CheckpointConfig, JobConfig, TrainConfig
from polytrain.core.cadence import checkpoint_due


def _job(dir: str, every: int, steps: int = 10) -> JobConfig:
    return JobConfig(
        train=TrainConfig(steps=steps), checkpoint=CheckpointConfig(dir=dir, every=every)
    )


def test_every_n_and_always_the_last() -> None:
    due = [s for s in range(1, 11) if checkpoint_due(_job("ckpt", 4), s)]
    assert due == [4, 8, 10]


def test_only_the_last_without_every() -> None:
    assert [s for s in range(1, 11) if checkpoint_due(_job("ckpt", 0), s)] == [10]


def test_never_without_a_directory() -> None:
    assert not any(checkpoint_due(_job("", 2), s) for s in range(1, 11))

"""Which job a checkpoint belongs to and what may change across a resume: the job's
fingerprint (every rank must hold the same job), the per-family state that must carry over,
and the trajectory settings a resume warns about. Plain functions (`check_same_job` is a
collective); no files are read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from polytrain.comm.agree import differing_ranks, fingerprint
from polytrain.config.base import describe_field, to_dict
from polytrain.config.job import JobConfig
from polytrain.core.registry import StrategyFamily, family_for
from polytrain.errors import CheckpointError, ConfigError
from polytrain.trainer.build import FAMILIES

__all__ = ["check_same_job", "check_state_carries_over", "job_differences", "job_fingerprint"]

_PER_NODE = {"launch": ("node_rank",), "observe": ("out_dir", "progress", "trace")}


def job_fingerprint(job: JobConfig, world_size: int) -> str:
    """A digest of the job and layout, leaving out what may differ between nodes."""
    data = to_dict(job)
    for section, keys in _PER_NODE.items():
        for key in keys:
            data.get(section, {}).pop(key, None)
    data.get("checkpoint", {}).pop("resume", None)  # restarts resume implicitly
    text = json.dumps({"job": data, "world_size": world_size}, sort_keys=True, default=str)
    return f"{fingerprint(text):016x}"


def check_same_job(job: JobConfig, world_size: int) -> None:
    """Collective pre-flight: every rank must have been given the same job and layout."""
    differ = differing_ranks(int(job_fingerprint(job, world_size), 16))
    if differ:
        raise ConfigError(
            f"rank(s) {differ} were given a different job or layout than rank 0 (compared: "
            "every config field except launch.node_rank and observe.*): start every node "
            "with the same --config file and flags"
        )


_TRAJECTORY = ("model", "data", "optim", "train")  # what a resumed run's trajectory depends on


def check_state_carries_over(
    saved: dict[str, Any],
    saved_family: str | None,
    job: JobConfig,
    path: Path,
    families: tuple[StrategyFamily, ...] = FAMILIES,
) -> None:
    """Refuse a resume that would drop state the checkpoint holds beyond the model and its
    optimizer, or start that state afresh as if it had been saved: each family declares the
    settings that state depends on (``StrategyFamily.state_settings``), and those of the saving
    and the resuming job's families are compared. A job of another family holds no such state,
    so counts as the setting's default. Every rank reads the same manifest, so every rank
    refuses alike. ``saved_family`` is None for a checkpoint that did not record it."""
    current = family_for(job, families)
    saved_family = saved_family or current.name  # unrecorded: assume the job's own
    now = to_dict(job)
    for family in families:
        for key, state in family.state_settings.items():
            default = describe_field(JobConfig, key).default
            old = _lookup(saved, key, default) if family.name == saved_family else default
            new = _lookup(now, key, default) if family is current else default
            if old != new:
                raise CheckpointError(
                    f"{path} was saved with {key} = {old!r} and this job has {new!r}: {state} "
                    f"cannot carry over; resume with --set {key}={old} or start from another "
                    "--checkpoint-dir"
                )


def _lookup(job: dict[str, Any], key: str, default: Any) -> Any:
    """The value at dotted ``key`` of a job's plain dict (``default`` where it is absent)."""
    value: Any = job
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return default
        value = value[part]
    return value


def job_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``section.key = saved -> current`` for the fields that shape the training trajectory."""
    out = []
    for section in _TRAJECTORY:
        old, new = saved.get(section, {}), current.get(section, {})
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                out.append(f"{section}.{key} = {old.get(key)!r} -> {new.get(key)!r}")
    return out

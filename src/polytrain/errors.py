"""User-facing errors (ARCHITECTURE contract 6).

Every error a user can cause is a `PolytrainError`. Its message is one line that states the value
that was given, what was expected, and how to fix it. The CLI prints that line and exits with code
2; internal invariants use `assert` instead.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ClusterError",
    "ConfigError",
    "MeshError",
    "OutputError",
    "PartitionError",
    "PlanError",
    "PolytrainError",
    "ProtocolError",
    "ScheduleError",
]


class PolytrainError(ValueError):
    """Base class of every mistake a user can make and fix."""


class ConfigError(PolytrainError):
    """A job description key, type or value is invalid."""


class MeshError(PolytrainError):
    """The parallel degrees do not fit the world size or the model."""


class ScheduleError(PolytrainError):
    """A pipeline schedule is malformed or cannot be built."""


class PartitionError(PolytrainError):
    """A pipeline partition is impossible (too many stages, memory limit, bad counts)."""


class PlanError(PolytrainError):
    """The planner cannot satisfy the request."""


class CheckpointError(PolytrainError):
    """A checkpoint is missing, incomplete, corrupt or incompatible."""


class ProtocolError(PolytrainError):
    """A parameter-server or gossip message is malformed or does not match the job."""


class ClusterError(PolytrainError):
    """The nodes of a multi-node job cannot meet or disagree (endpoint, --nnodes, --node-rank)."""


class OutputError(PolytrainError):
    """An output path cannot be written, or was taken by someone else during the run."""

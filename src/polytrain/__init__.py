"""polytrain: train a PyTorch model under every classic parallel strategy from one job description."""

from polytrain.errors import (
    CheckpointError,
    ConfigError,
    MeshError,
    PartitionError,
    PlanError,
    PolytrainError,
    ScheduleError,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "JobConfig",
    "MeshError",
    "PartitionError",
    "PlanError",
    "PolytrainError",
    "ScheduleError",
    "__version__",
    "load",
    "prepare",
    "run",
]

_LAZY = {
    "load": "polytrain.api",
    "prepare": "polytrain.api",
    "run": "polytrain.api",
    "JobConfig": "polytrain.config.job",
}


def __getattr__(name: str) -> object:
    """Import the torch-backed entry points on first use, so the pure modules (topology,
    schedules, consistency rules) import without torch."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'polytrain' has no attribute {name!r}")

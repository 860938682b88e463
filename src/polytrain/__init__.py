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
    "MeshError",
    "PartitionError",
    "PlanError",
    "PolytrainError",
    "ScheduleError",
    "__version__",
]

"""Typed job configuration (ARCHITECTURE contract 2)."""

from polytrain.config.base import from_dict, to_dict
from polytrain.config.io import job_from_dict, load_job, merge, parse_override, save_job
from polytrain.config.job import (
    CheckpointConfig,
    DataConfig,
    GossipConfig,
    JobConfig,
    LaunchConfig,
    LocalSGDConfig,
    ModelConfig,
    ObserveConfig,
    OptimConfig,
    ParallelConfig,
    PipelineConfig,
    PSConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "GossipConfig",
    "JobConfig",
    "LaunchConfig",
    "LocalSGDConfig",
    "ModelConfig",
    "ObserveConfig",
    "OptimConfig",
    "PSConfig",
    "ParallelConfig",
    "PipelineConfig",
    "TrainConfig",
    "from_dict",
    "job_from_dict",
    "load_job",
    "merge",
    "parse_override",
    "save_job",
    "to_dict",
]

"""What ``train.device = "auto"`` and ``launch.nproc = "auto" | "gpu"`` mean on this machine.

[Note: device resolution] A job resolves its devices once, when `JobConfig` is built in the
launching process: ``train.device = "auto"`` becomes ``cuda`` where torch sees a GPU and ``cpu``
elsewhere; ``launch.nproc = "gpu"`` becomes the number of visible GPUs (torchrun's
``--nproc-per-node gpu``), and ``"auto"`` that number on a CUDA job and `CPU_PROCS` CPU
processes otherwise. The run's ``job.toml`` holds the resolved values, so the workers, which load
it, never probe again and every rank holds the same job (`trainer.resume_checks.check_same_job`);
an explicit ``--device cpu`` on a GPU machine keeps the CPU. ``launch.backend = "auto"`` is
resolved where the group starts (`comm.init.resolve_backend`: nccl on cuda, gloo on cpu).
"""

from __future__ import annotations

from typing import Literal

import torch

from polytrain.errors import ConfigError

__all__ = ["CPU_PROCS", "resolve_devices", "visible_gpus"]

CPU_PROCS = 2
"""Worker processes of ``launch.nproc = "auto"`` on the CPU (the default job's two workers)."""


def visible_gpus() -> int:
    """CUDA devices torch can use in this process (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_devices(device: str, nproc: int | str) -> tuple[Literal["cpu", "cuda"], int]:
    """(``train.device``, ``launch.nproc``) as this machine runs them ([Note: device
    resolution]); `ConfigError` for a CUDA device or one process per GPU where there is none."""
    if device == "cpu" and isinstance(nproc, int):
        return "cpu", nproc  # nothing to probe (every CPU job and test)
    gpus = visible_gpus()
    resolved: Literal["cpu", "cuda"] = "cpu" if device == "cpu" else "cuda"
    if device == "auto" and not gpus:
        resolved = "cpu"
    if resolved == "cuda" and not gpus:
        raise ConfigError(
            "train.device = 'cuda' but torch sees no CUDA device here (torch "
            f"{torch.__version__}): set train.device = 'cpu' (or 'auto')"
        )
    if nproc == "gpu":
        if not gpus:
            raise ConfigError(
                f"launch.nproc = 'gpu' but torch sees no GPU here (torch {torch.__version__}): "
                f"pass --nproc N for N CPU processes (e.g. --nproc {CPU_PROCS})"
            )
        return resolved, gpus
    if nproc == "auto":
        return resolved, gpus if resolved == "cuda" else CPU_PROCS
    assert isinstance(nproc, int), nproc  # the config's type check admits only these
    return resolved, nproc

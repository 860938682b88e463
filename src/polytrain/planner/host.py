"""This host's identity and its saved calibration profile (torch-facing, nothing else).

A profile (`polytrain calibrate`, `planner.calibrate`) is kept per fingerprint of the facts it
depends on; anything that wants this host's numbers (`polytrain plan`, ``--strategy auto``, a
parameter server choosing its chunk size) finds it here without importing the calibration
itself, which imports the strategies it measures.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from polytrain.planner.catalog import device_key_of
from polytrain.planner.profile_io import cache_dir, fingerprint, load_profile, profile_path
from polytrain.planner.types import HostProfile

__all__ = ["describes", "host_identity", "profile_for", "saved_profile"]


def host_identity(threads: int = 1) -> dict[str, str]:
    """The facts a profile depends on; its fingerprint changes when any of them does."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "gpu": gpu,
        "torch": torch.__version__,
        "threads": str(threads),
    }


def saved_profile(threads: int = 1, directory: Path | None = None) -> HostProfile | None:
    """This host's calibrated profile if `polytrain calibrate` saved one, else None (what
    `polytrain plan` and ``--strategy auto`` use for a cluster of this host's CPUs)."""
    path = profile_path(fingerprint(host_identity(threads)), directory or cache_dir())
    return load_profile(path) if path.exists() else None


def describes(profile: HostProfile, device_key: str) -> bool:
    """Whether ``profile`` was measured on the catalog device ``device_key``: "cpu" for a host
    without a GPU, else the catalog's key for the GPU's name (`catalog.device_key_of`)."""
    if device_key == "cpu":
        return profile.device == "cpu"
    return device_key_of(profile.device) == device_key


def profile_for(device_key: str, threads: int = 1) -> HostProfile | None:
    """This host's saved profile when it describes the catalog device ``device_key`` (a
    cluster of this host's kind of device), else None: a plan for other hardware uses the
    catalog's figures."""
    profile = saved_profile(threads)
    return profile if profile is not None and describes(profile, device_key) else None

"""This host's identity and its saved calibration profile (torch-facing, nothing else).

A profile (`polytrain calibrate`, `measure.calibrate`) is kept per fingerprint of the facts it
depends on; anything that wants this host's numbers (`polytrain plan`, ``--strategy auto``, a
parameter server choosing its chunk size) finds it here without importing the calibration
itself, which imports the strategies it measures.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from polytrain.measure.timing import Rounds
from polytrain.planner.catalog import device_key_of
from polytrain.planner.profile_io import cache_dir, fingerprint, load_profile, profile_path
from polytrain.planner.types import HostProfile

__all__ = [
    "describes",
    "host_identity",
    "operator_chain",
    "profile_for",
    "saved_profile",
    "speed_rates",
    "speed_rounds",
    "speed_sample",
]


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


_SPEED_N = 512  # the speed figures' matmul size
_SPEED_COPY_BYTES = 64 * 2**20  # past a CPU's last-level cache
# the work of one call of each speed figure's function (its rate is this over its seconds)
_SPEED_WORK = {
    "matmul fp32": 2.0 * _SPEED_N**3,  # FLOPs
    "matmul fp32, all cores": 2.0 * _SPEED_N**3,  # FLOPs, the host's every core on one call
    "matmul half": 2.0 * _SPEED_N**3,
    "operator": 1.0,  # one chain of 128 tiny operator calls, forward and backward
    "copy": 2.0 * _SPEED_COPY_BYTES,  # bytes read and written
}


def operator_chain(device: torch.device) -> Callable[[], None]:
    """A forward and backward through 64 multiply-adds of 16 values: operator calls whose data
    is negligible (`calibrate`'s operator figure and the "operator" speed figure time it)."""
    x = torch.ones(16, device=device, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(64):
            y = y * 1.0001 + 0.0001
        y.sum().backward()

    return chain


def speed_rounds(threads: int = 1, budget_s: float = 0.2) -> Rounds[str]:
    """[Note: host drift] in planner/drift.py: timing rounds ([Note: timing rounds]) of this
    host's `drift.SPEED_FIGURES` (an fp32 and a bf16 512 matmul, the fp32 one again on every
    core, a chain of 128 tiny operator calls forward and backward, a 64 MiB copy) with
    ``threads`` intra-op threads; `calibrate` runs them beside its matmul rounds, `speed_rates`
    reads them."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    a32 = torch.randn(_SPEED_N, _SPEED_N, device=device)
    a16 = a32.to(torch.bfloat16)
    src = torch.ones(_SPEED_COPY_BYTES // 4, device=device)
    dst = torch.empty_like(src)
    cores = os.cpu_count() or 1

    def all_cores() -> None:  # the round sets ``threads``; this call uses every core
        torch.set_num_threads(cores)
        torch.matmul(a32, a32)
        torch.set_num_threads(threads)

    fns: dict[str, Callable[[], object]] = {
        "matmul fp32": partial(torch.matmul, a32, a32),
        "matmul fp32, all cores": all_cores,
        "matmul half": partial(torch.matmul, a16, a16),
        "operator": operator_chain(device),
        "copy": partial(dst.copy_, src),
    }
    return Rounds(fns, device, budget_s, threads=threads)


def speed_rates(rounds: Rounds[str]) -> dict[str, tuple[float, float]]:
    """(rate, spread) of each speed figure of `speed_rounds`, running the rounds left."""
    return {
        name: (_SPEED_WORK[name] / secs, spread) for name, (secs, spread) in rounds.result().items()
    }


def speed_sample(threads: int = 1, budget_s: float = 0.2) -> dict[str, float]:
    """This host's speed figures now (`speed_rounds` back to back, ~0.5 s): what `polytrain
    plan --validate`, `calibrate --check` and the planner benchmark hold against a profile's."""
    return {name: rate for name, (rate, _) in speed_rates(speed_rounds(threads, budget_s)).items()}

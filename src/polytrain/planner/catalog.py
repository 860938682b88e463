"""Hardware catalog: devices, links and prices as TOML data files shipped in the package.

Every figure carries its source in the TOML (``catalog/*.toml``); this module only reads and
converts units (TFLOP/s -> FLOP/s, GB/s -> bytes/s, GiB -> bytes). Pure Python, no torch.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from polytrain._toml import tomllib
from polytrain.errors import PlanError

__all__ = [
    "Device",
    "Link",
    "dense_peak",
    "device",
    "device_key_of",
    "device_names",
    "link",
    "link_names",
    "price",
]

_GIB = 1 << 30


@dataclass(frozen=True)
class Device:
    """One accelerator (or CPU host) as the cost model sees it."""

    key: str  # catalog key, e.g. "H100"
    name: str
    memory: float  # bytes
    mem_bw: float  # bytes / s
    peak_flops: dict[str, float]  # dtype -> FLOP/s (dense)
    intra_link: str  # default link between devices of one host
    efficiency: float  # achieved / peak for a training step without a HostProfile
    source: str = ""

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s in ``dtype``; bf16 falls back to fp16, any dtype to fp32 (a device
        without fast bf16, like the M40, computes it at its fp32 rate)."""
        for key in (dtype, "fp16" if dtype == "bf16" else dtype, "fp32"):
            if key in self.peak_flops:
                return self.peak_flops[key]
        raise PlanError(f"device {self.key} has no FLOP/s figure for {dtype!r}")


@dataclass(frozen=True)
class Link:
    """A link, per direction: alpha-beta model ``latency + bytes / bandwidth``."""

    key: str
    name: str
    bandwidth: float  # bytes / s, one direction
    latency: float  # seconds per hop
    base: float = 0.0  # seconds paid once per collective (NCCL's baseLat)
    source: str = ""


def _load(name: str) -> dict[str, Any]:
    text = resources.files("polytrain.planner").joinpath("catalog", name).read_text()
    return tomllib.loads(text)


@cache
def _devices() -> dict[str, Device]:
    out: dict[str, Device] = {}
    for key, row in _load("devices.toml").items():
        if "flops_per_cycle" in row:  # a CPU host: cores x clock x FLOP per cycle
            cores = float(row.get("cores", os.cpu_count() or 1))
            hz = float(row.get("ghz", _cpu_ghz())) * 1e9
            peak = {k: cores * hz * float(v) for k, v in row["flops_per_cycle"].items()}
        else:
            peak = {k: float(v) * 1e12 for k, v in row["peak_tflops"].items()}
        memory = float(row["memory_gib"]) * _GIB or _host_memory()
        out[key] = Device(
            key=key,
            name=row["name"],
            memory=memory,
            mem_bw=float(row["mem_bw_gbs"]) * 1e9,
            peak_flops=peak,
            intra_link=row["intra_link"],
            efficiency=float(row["efficiency"]),
            source=row["source"],
        )
    return out


@cache
def _links() -> dict[str, Link]:
    return {
        key: Link(
            key=key,
            name=row["name"],
            bandwidth=float(row["bandwidth_gbs"]) * 1e9,
            latency=float(row["latency_us"]) * 1e-6,
            base=float(row.get("base_us", 0.0)) * 1e-6,
            source=row["source"],
        )
        for key, row in _load("links.toml").items()
    }


@cache
def _prices() -> dict[str, float]:
    return {k: float(v["usd_per_device_hour"]) for k, v in _load("prices.toml").items()}


def _lookup(table: dict[str, Any], key: str, what: str) -> Any:
    for name, value in table.items():
        if name.lower() == key.lower():
            return value
    raise PlanError(f"unknown {what} {key!r}: expected one of {', '.join(table)}")


def device(key: str) -> Device:
    """The catalog device ``key`` (case-insensitive); unknown keys list the valid ones."""
    return _lookup(_devices(), key, "device")


def link(key: str) -> Link:
    """The catalog link ``key`` (case-insensitive); unknown keys list the valid ones."""
    return _lookup(_links(), key, "link")


def price(key: str) -> float | None:
    """On-demand dollars per device-hour, or None when the catalog has no price."""
    for name, value in _prices().items():
        if name.lower() == key.lower():
            return value
    return None


def device_names() -> list[str]:
    return list(_devices())


def device_key_of(gpu_name: str) -> str | None:
    """The catalog key of the GPU torch names ``gpu_name``: the longest key whose every
    ``-``-separated part is a word of the name ("H100" for "NVIDIA H100 80GB HBM3",
    "A100-80GB" for "NVIDIA A100-SXM4-80GB"), or None when the catalog has none. Whole words,
    so an L40S is not taken for an L4 nor a GH200 for an H200."""
    words = set(re.split(r"[\s\-_]+", gpu_name.lower()))
    keys = [
        k
        for k in device_names()
        if k != "cpu" and all(part in words for part in k.lower().split("-"))
    ]
    return max(keys, key=len) if keys else None


def dense_peak(gpu_name: str, dtype: str) -> float | None:
    """The catalog's dense peak FLOP/s in ``dtype`` (`Device.flops`) of the GPU torch names
    ``gpu_name``, or None when the catalog does not know it (MFU is then not reported rather
    than guessed)."""
    key = device_key_of(gpu_name)
    return device(key).flops(dtype) if key is not None else None


def link_names() -> list[str]:
    return list(_links())


def _cpu_ghz() -> float:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return float(line.split(":")[1]) / 1000
    except OSError:
        pass
    return 2.5  # [Note: cpu fallback] only when /proc is missing; calibrate replaces it


def _host_memory() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 8.0 * _GIB

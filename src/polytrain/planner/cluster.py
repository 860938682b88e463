"""A cluster to plan for: hosts x devices per host x device, and the links between them.

Written as a short spec, ``4x8xH100:ib400`` (4 hosts of 8 H100 joined by InfiniBand NDR), or a
TOML file (see `load_cluster`). Pure Python, no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from polytrain._toml import tomllib
from polytrain.errors import PlanError
from polytrain.planner.catalog import Device, Link, device, device_names, link, link_names, price

__all__ = ["Cluster", "load_cluster", "parse_cluster"]

_SPEC = re.compile(r"^(?:(\d+)x)?(?:(\d+)x)?([A-Za-z][A-Za-z0-9-]*)(?::([A-Za-z0-9]+))?$")
_FORM = "expected HOSTSxDEVICESxDEVICE[:LINK], e.g. 4x8xH100:ib400, 8xA100-80GB or 1x2xcpu"


@dataclass(frozen=True)
class Cluster:
    """Identical hosts; devices of one host share `intra`, hosts talk over `inter`.

    [Note: one NIC per device] With ``nic = "device"`` (GPU clusters' default) `inter` is the
    bandwidth of ONE device's share of the network (rail-optimized clusters such as DGX A100/H100
    give each GPU its own NIC), so a collective across hosts is limited by `inter.bandwidth` per
    device, not divided by devices per host. With ``nic = "host"`` (CPU workers' default, cloud
    VMs, the emulated cluster of `polytrain.testing.cluster`) `inter` is the host's one link,
    shared by the ring flows that cross it at the same time: see `bandwidth_for`.
    """

    hosts: int
    per_host: int
    device: Device
    intra: Link
    inter: Link | None
    price_per_device_hour: float | None
    nic: str = "device"  # "device": one NIC per device; "host": one shared NIC per host

    @property
    def size(self) -> int:
        return self.hosts * self.per_host

    def describe(self) -> str:
        where = f" over {self.inter.key}" if self.inter and self.hosts > 1 else ""
        return f"{self.hosts} x {self.per_host} x {self.device.key}{where}"

    def link_for(self, stride: int, size: int) -> Link:
        """The slowest link a group of ``size`` ranks ``stride`` apart crosses.

        Ranks are laid out host by host (rank // per_host is the host), so the group stays in
        one host iff its span ``stride * size`` fits in a host (topology's [Note: axis order]).
        """
        if size <= 1 or stride * size <= self.per_host or self.inter is None:
            return self.intra
        return self.inter

    def bandwidth_for(self, stride: int, size: int) -> float:
        """Bytes/s one ring flow of such a group gets on `link_for`'s link.

        [Note: shared host link] Every rank of a host runs a group of the same axis at once,
        and a ring over a group whose members sit contiguously on each host crosses each host's
        link once per direction. A group with ``m`` members per host therefore shares the host
        link with ``per_host / m - 1`` other groups' flows. Measured on the emulated 2 x 2
        cluster (benchmarks/multihost, "planner"): the flat 4-rank ring gets the whole link, the
        two cross-host dp pairs half of it each.
        """
        link = self.link_for(stride, size)
        if link is self.intra or self.nic != "host":
            return link.bandwidth
        members = max(1, min(size, self.per_host // stride)) if stride < self.per_host else 1
        flows = max(1, self.per_host // members)
        return link.bandwidth / flows

    def with_size(self, devices: int) -> Cluster:
        """The same hardware cut to ``devices`` devices (whole hosts first)."""
        if devices <= self.per_host:
            return Cluster(
                1,
                devices,
                self.device,
                self.intra,
                self.inter,
                self.price_per_device_hour,
                self.nic,
            )
        hosts = -(-devices // self.per_host)
        return Cluster(
            hosts,
            self.per_host,
            self.device,
            self.intra,
            self.inter,
            self.price_per_device_hour,
            self.nic,
        )


def parse_cluster(spec: str) -> Cluster:
    """A catalog spec (``4x8xH100:ib400``) or the path of a cluster TOML file."""
    text = spec.strip()
    if text.endswith(".toml") or Path(text).is_file():
        return load_cluster(Path(text))
    match = _SPEC.match(text)
    if match is None:
        raise PlanError(f"malformed cluster spec {spec!r}: {_FORM}")
    first, second, dev, inter = match.groups()
    if second is not None:
        hosts, per_host = int(first), int(second)
    else:
        hosts, per_host = 1, int(first) if first is not None else 1
    return _build(hosts, per_host, dev, inter, None, None, None, origin=spec)


def load_cluster(path: Path) -> Cluster:
    """A cluster TOML::

    [cluster]
    hosts = 4
    devices_per_host = 8
    device = "H100"
    inter_link = "ib400"        # needed when hosts > 1
    intra_link = "nvlink4"      # optional: the device's default
    price_per_device_hour = 2.5 # optional: the catalog's on-demand price
    nic = "device"              # optional: "device" (one NIC per device) or "host" (one shared);
                                # default "host" for cpu, "device" otherwise ([Note: one NIC per
                                # device])
    # optional, each replacing the catalog's figure ([Note: cluster overrides]), in its units:
    memory_gib = 94             # the device's memory
    peak_tflops = { bf16 = 835.5 }  # dense peak per dtype (the others stay the catalog's)
    mem_bw_gbs = 3900           # memory bandwidth
    efficiency = 0.4            # achieved / peak of a step without a calibrated profile
    intra_bandwidth_gbs = 300   # a link, per direction; also inter_bandwidth_gbs
    intra_latency_us = 3.4      # per hop; also inter_latency_us
    """
    if not path.is_file():
        raise PlanError(
            f"cluster file {str(path)!r} does not exist: give a path or a spec ({_FORM})"
        )
    try:
        data: dict[str, Any] = tomllib.loads(path.read_text()).get("cluster", {})
    except tomllib.TOMLDecodeError as exc:
        raise PlanError(f"cluster file {str(path)!r} is not valid TOML: {exc}") from None
    known = {
        "hosts",
        "devices_per_host",
        "device",
        "inter_link",
        "intra_link",
        "price_per_device_hour",
        "nic",
        *_DEVICE_FIGURES,
        *_LINK_FIGURES,
    }
    unknown = sorted(set(data) - known)
    if unknown:
        raise PlanError(
            f"cluster file {str(path)!r}: unknown key {unknown[0]!r}: expected {', '.join(sorted(known))}"
        )
    if "device" not in data:
        raise PlanError(
            f"cluster file {str(path)!r} names no device: add device = one of {', '.join(device_names())}"
        )
    price_in = data.get("price_per_device_hour")
    cluster = _build(
        int(data.get("hosts", 1)),
        int(data.get("devices_per_host", 1)),
        str(data["device"]),
        data.get("inter_link"),
        data.get("intra_link"),
        float(price_in) if price_in is not None else None,
        str(data["nic"]) if "nic" in data else None,
        origin=str(path),
    )
    return _overridden(cluster, data, str(path))


# [Note: cluster overrides] A cluster TOML may replace any catalog figure of its device or
# links, for hardware the catalog lacks or that runs off its datasheet (a power cap, a
# different memory size, a measured link): key -> (unit to SI, the field it sets)
_DEVICE_FIGURES = {
    "memory_gib": (float(2**30), "memory"),
    "mem_bw_gbs": (1e9, "mem_bw"),
    "efficiency": (1.0, "efficiency"),
    "peak_tflops": (1e12, "peak_flops"),
}
_LINK_FIGURES = {
    f"{side}_{figure}": (unit, side, field)
    for side in ("intra", "inter")
    for figure, unit, field in (
        ("bandwidth_gbs", 1e9, "bandwidth"),
        ("latency_us", 1e-6, "latency"),
    )
}


def _overridden(cluster: Cluster, data: dict[str, Any], origin: str) -> Cluster:
    """``cluster`` with the figures ``data`` gives in place of the catalog's."""

    def positive(key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise PlanError(f"cluster {origin!r}: {key} = {value!r}: expected a positive number")
        return float(value)

    device_fields: dict[str, Any] = {}
    for key, (unit, name) in _DEVICE_FIGURES.items():
        if key not in data:
            continue
        if key == "peak_tflops":
            if not isinstance(data[key], dict):
                raise PlanError(
                    f"cluster {origin!r}: peak_tflops = {data[key]!r}: expected a table such "
                    "as { bf16 = 835.5, fp32 = 60 }"
                )
            peaks = {k: positive(f"peak_tflops.{k}", v) * unit for k, v in data[key].items()}
            device_fields[name] = {**cluster.device.peak_flops, **peaks}
        else:
            device_fields[name] = positive(key, data[key]) * unit
    links = {"intra": cluster.intra, "inter": cluster.inter}
    for key, (unit, side, name) in _LINK_FIGURES.items():
        if key not in data:
            continue
        current = links[side]
        if current is None:
            raise PlanError(f"cluster {origin!r}: {key} is set but the cluster has no inter_link")
        figure = positive(key, data[key]) * unit
        if name == "bandwidth":
            links[side] = replace(current, bandwidth=figure)
        else:
            links[side] = replace(current, latency=figure)
    return replace(
        cluster,
        device=replace(cluster.device, **device_fields),
        intra=links["intra"] or cluster.intra,
        inter=links["inter"],
    )


def _build(
    hosts: int,
    per_host: int,
    dev_key: str,
    inter_key: str | None,
    intra_key: str | None,
    price_in: float | None,
    nic: str | None,
    *,
    origin: str,
) -> Cluster:
    if hosts < 1 or per_host < 1:
        raise PlanError(
            f"cluster {origin!r} has {hosts} hosts x {per_host} devices: both must be >= 1"
        )
    dev = device(dev_key)
    if hosts > 1 and inter_key is None:
        raise PlanError(
            f"cluster {origin!r} spans {hosts} hosts but names no link between them: add one, "
            f"e.g. ':ib400' (links: {', '.join(link_names())})"
        )
    if price_in is not None and price_in < 0:
        raise PlanError(f"cluster {origin!r}: price_per_device_hour = {price_in} is negative")
    if nic not in (None, "device", "host"):
        raise PlanError(f'cluster {origin!r}: nic = {nic!r}: expected "device" or "host"')
    return Cluster(
        hosts=hosts,
        per_host=per_host,
        device=dev,
        intra=link(intra_key or dev.intra_link),
        inter=link(inter_key) if inter_key else None,
        price_per_device_hour=price_in if price_in is not None else price(dev.key),
        nic=nic or ("host" if dev.key == "cpu" else "device"),
    )

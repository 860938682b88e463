"""Choose and install the hierarchical all-reduce DDP hook (comm/hierarchical.py).

``parallel.hierarchical``: ``off`` keeps DDP's flat all-reduce; ``on`` installs the hook
whenever the data-parallel group spans more than one host with more than one of its ranks on
some host (otherwise both forms are the same collective); ``auto`` does that only where a
measurement says it is faster: each form all-reduces one DDP bucket's worth of floats a few
times at start-up, every rank takes the slowest rank's median, and the hook is installed when
it beats the flat all-reduce by ``AUTO_MARGIN``. Every rank therefore makes the same choice.
"""

from __future__ import annotations

import os

from torch.nn.parallel import DistributedDataParallel as DDP

from polytrain.comm.hierarchical import (
    flat_all_reduce,
    hierarchical_all_reduce,
    hierarchical_hook,
    host_groups,
    split_by_host,
    time_all_reduce,
)
from polytrain.comm.mesh import Mesh
from polytrain.config.job import ParallelConfig

__all__ = ["AUTO_MARGIN", "apply_hierarchical", "ranks_per_host"]

AUTO_MARGIN = 0.9  # hierarchical must take at most 90 % of the flat time to be chosen
_PROBE_MAX_NUMEL = 1 << 20  # 4 MiB of float32: enough to see bandwidth, short to measure


def ranks_per_host() -> int:
    """Worker ranks per host, from the elastic launcher (``LOCAL_WORLD_SIZE``)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or 1


def apply_hierarchical(
    ddp: DDP, mesh: Mesh, cfg: ParallelConfig, *, per_host: int | None = None
) -> str:
    """Install the hierarchical hook on ``ddp`` if ``cfg.hierarchical`` says so.

    Returns what was done, for the run's log: ``"off"``, ``"flat"`` (nothing to gain: one host,
    or one rank per host) or ``"hierarchical"``; with ``auto``, the measured times follow.
    """
    if cfg.hierarchical == "off":
        return "off"
    per_host = per_host or ranks_per_host()
    dp_groups = mesh.dims.all_groups("dp")
    hosts = split_by_host(dp_groups[0], per_host)
    if len(hosts) < 2 or all(len(h) == 1 for h in hosts):
        return "flat"
    groups = host_groups(dp_groups, mesh.group("dp"), per_host)
    note = ""
    if cfg.hierarchical == "auto":
        numel = min(_PROBE_MAX_NUMEL, int(cfg.bucket_mb * 2**20 / 4))
        dp = mesh.group("dp")
        flat = time_all_reduce(flat_all_reduce(dp), numel, dp)
        tiered = time_all_reduce(lambda t: hierarchical_all_reduce(t, groups), numel, dp)
        note = f" (flat {flat * 1e3:.1f} ms, hierarchical {tiered * 1e3:.1f} ms)"
        if tiered > AUTO_MARGIN * flat:
            return "flat" + note
    ddp.register_comm_hook(groups, hierarchical_hook)
    return "hierarchical" + note

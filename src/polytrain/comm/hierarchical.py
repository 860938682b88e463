"""Hierarchical all-reduce: reduce inside a host, all-reduce across hosts, broadcast back.

A flat ring over ``H`` hosts of ``L`` ranks sends each gradient byte ``2 (HL - 1) / HL`` times
per rank and crosses the slow inter-host links on ``H`` of its hops; the hierarchical form
moves the whole gradient between hosts once per host (``2 (H - 1) / H`` of it per host leader
on the inter-host ring) and keeps the rest on the host's loopback (the "two-level" reduction of
Goyal et al. 2017 and Horovod's hierarchical all-reduce). It pays when the link between hosts
is much slower than the one inside a host, and costs an extra local reduce and broadcast when
it is not, so `parallel.hierarchical.choose` measures both before using it.

[Note: host groups] A rank's host is ``rank // ranks_per_host``: the elastic launcher gives node
``k`` the global ranks ``k * nproc ... (k + 1) * nproc - 1`` (launch/multinode.py keeps the node
ranks the user gave). For each data-parallel group, `HostGroups` makes one group per host (its
ranks in that dp group) and one group of the hosts' leaders (the lowest such rank on each
host). ``new_group`` is collective over the whole world, so every rank creates every
group of every dp group, in the same order.

[Note: blocking hook] The hook runs its three collectives to completion and returns a finished
future: chaining a second collective from a gloo future's callback would wait inside gloo's
own worker thread. The price is DDP's overlap of communication with the rest of backward,
which the measurement in `choose` sees.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from polytrain.comm.init import new_group

__all__ = [
    "HostGroups",
    "hierarchical_all_reduce",
    "hierarchical_hook",
    "host_groups",
    "time_all_reduce",
]


@dataclass
class HostGroups:
    """This rank's groups for one data-parallel group (see [Note: host groups])."""

    dp_group: dist.ProcessGroup
    intra: dist.ProcessGroup  # this rank's host, within its dp group
    leader: int  # global rank of this host's leader
    inter: dist.ProcessGroup | None  # the leaders of every host; None on non-leaders
    num_hosts: int


def split_by_host(ranks: list[int], ranks_per_host: int) -> list[list[int]]:
    """``ranks`` split into the hosts that hold them, in host order."""
    hosts: dict[int, list[int]] = {}
    for r in ranks:
        hosts.setdefault(r // ranks_per_host, []).append(r)
    return [hosts[h] for h in sorted(hosts)]


def host_groups(
    dp_groups: list[list[int]], dp_group: dist.ProcessGroup, ranks_per_host: int
) -> HostGroups:
    """Create the per-host and leader groups of every dp group; return this rank's."""
    me = dist.get_rank()
    mine: HostGroups | None = None
    for ranks in dp_groups:
        hosts = split_by_host(ranks, ranks_per_host)
        leaders = [h[0] for h in hosts]
        intra_groups = [new_group(h) for h in hosts]
        inter = new_group(leaders)
        for host, intra in zip(hosts, intra_groups, strict=True):
            if me in host:
                mine = HostGroups(
                    dp_group=dp_group,
                    intra=intra,
                    leader=host[0],
                    inter=inter if me == host[0] else None,
                    num_hosts=len(hosts),
                )
    assert mine is not None, "every rank belongs to one dp group"
    return mine


def hierarchical_all_reduce(tensor: torch.Tensor, groups: HostGroups) -> torch.Tensor:
    """Sum ``tensor`` over the dp group in place: reduce to the leader, leaders all-reduce,
    leader broadcasts."""
    dist.reduce(tensor, dst=groups.leader, group=groups.intra)
    if groups.inter is not None and groups.num_hosts > 1:
        dist.all_reduce(tensor, group=groups.inter)
    dist.broadcast(tensor, src=groups.leader, group=groups.intra)
    return tensor


def hierarchical_hook(
    groups: HostGroups, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average a bucket hierarchically ([Note: blocking hook])."""
    buffer = bucket.buffer()
    buffer.div_(groups.dp_group.size())
    hierarchical_all_reduce(buffer, groups)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def time_all_reduce(
    reduce: Callable[[torch.Tensor], object], numel: int, group: dist.ProcessGroup, reps: int = 3
) -> float:
    """Median seconds of ``reduce`` on a float32 tensor of ``numel``, the slowest rank's
    (all ranks of ``group`` call it and get the same number)."""
    tensor = torch.ones(numel)
    reduce(tensor)  # warm up: connections, buffers
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        reduce(tensor)
        times.append(time.perf_counter() - start)
    median = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64)
    dist.all_reduce(median, op=dist.ReduceOp.MAX, group=group)
    return float(median.item())


def flat_all_reduce(group: dist.ProcessGroup) -> Callable[[torch.Tensor], object]:
    """The peer of `hierarchical_all_reduce` for `time_all_reduce`: one all-reduce."""
    return lambda tensor: dist.all_reduce(tensor, group=group)

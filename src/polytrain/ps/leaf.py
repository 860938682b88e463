"""Leaf servers: one server per group of workers between the workers and the root shards.

Rudra's hierarchical parameter server (Gupta, Zhang and Wang, "Model Accuracy and Runtime
Tradeoff in Distributed Deep Learning: A Systematic Study", ICDM 2016): "PS leaves" serve groups
of learners and carry their gradients and weights to the global parameter store, so the root
meets one leaf per group instead of every learner. Shapes: P = elements of the whole model.

[Note: leaf servers] With ``ps.leaves`` (``"host"``: the workers of one host, else that many
consecutive workers) the workers are split into groups (`leaf_groups`) and the lowest rank of
each group also runs its group's leaf on a thread, as a colocated server does ([Note:
colocated servers] in polytrain.ps.local): no extra ranks. A leaf is a `ParameterServer` over
the whole model (a one-shard layout of its own, so its own job fingerprint) in sync mode for its
group, talking over a process group of its group's ranks; its leader's messages take the local
link. What differs is its update: where a root server steps its optimizer, a leaf

1. pushes its group's sum times ``num_leaves / num_workers`` to the root shards as one pusher
   ([Note: gradient scale] in polytrain.ps.shard: the root's sync mean over leaves is then the
   global-batch mean, with unequal groups too), through an ordinary `WorkerClient` whose worker
   id is the leader's rank;
2. pulls the next clock from the root (which grants it per ``ps.mode``), copies it into its own
   flat copy and only then grants its group's pulls.

So the root's clocks, consistency rule, clipping and optimizer are those of a flat job whose
workers are the leaves. With ``ps.mode = "sync"`` the leaf pulls clock ``c + 1`` once every leaf
pushed ``c``: exactly the single-process run. With ``"async"`` or ``"ssp"`` each group is
synchronous inside and runs ahead of the root as the root allows it (Rudra's "sync inside,
async towards the root"); a leaf's ACKs report the root's slowest clock, so each worker's
``ps_staleness`` and the leaf's grant records (``<out_dir>/ps/leaf<i>.json``) hold the
staleness it sees, as SSP's records do. A leaf holds no optimizer and no state of its own: a
checkpoint is the root's, and resumes under any number of leaves (the leaf pulls the resumed
clock from the root before it grants anything). While it waits on the root the leaf keeps its
heartbeat, so its workers name a leaf that hangs, not one whose root is slow ([Note: hung
server] in polytrain.comm.ps_wire).

The final weights: leaf 0 (on rank 0) is the root's coordinator; when its group has left it
leaves the root, receives the root's final shards, hands them to rank 0 and stops at rank 0's
SHUTDOWN. Other leaves leave the root and stop.

[Note: re-homed groups] In async and ssp a group's workers do not need each other, so a dead
leaf need not end the job: the root holds every worker that is not a leaf's as a spare
(pending, never dropped for silence), and a worker whose leaf is lost (`PeerLost`, or its
heartbeat stopped: `PeerHung`) joins the root (`rehome`): from then on it is a flat async worker
of the root's layout pushing its gradient times ``num_leaves / num_workers``, as a leaf pushes
its group's sum. The step it lost is reported skipped; the root joins it at its current
``min_clock`` and the worker sends empty clocks up to its own next step (a push it had not
completed was never applied: [Note: atomic pushes] in ps.server). The root drops the dead leaf
as it drops a dead worker, with what it applied kept. Spares that never joined send the root a
LEAVE at the end. Rank 0 (leaf 0 and the coordinator) must survive, as in a flat job.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from polytrain.comm import ps_wire
from polytrain.config.job import JobConfig
from polytrain.ps.layout import ShardLayout
from polytrain.ps.server import ParameterServer
from polytrain.ps.sharding import host_groups
from polytrain.ps.worker import WorkerClient

__all__ = [
    "LeafServer",
    "build_leaf",
    "leaf_groups",
    "leaf_name",
    "leaf_size",
    "ranks_per_host",
]

_BEAT_S = 0.25


def ranks_per_host(job: JobConfig) -> int:
    """``ps.ranks_per_host``, else the launcher's LOCAL_WORLD_SIZE, else ``launch.nproc``."""
    if job.ps.ranks_per_host:
        return job.ps.ranks_per_host
    return int(os.environ.get("LOCAL_WORLD_SIZE", job.launch.num_procs))


def leaf_size(job: JobConfig) -> int:
    """Workers per leaf server: ``ps.leaves``, a host's for ``"host"`` (0: no leaves)."""
    return job.ps.workers_per_leaf(ranks_per_host(job))


def leaf_groups(workers: list[int], per_leaf: int) -> list[list[int]]:
    """The workers of each leaf: ``per_leaf`` consecutive ranks (a host's, for ``"host"``)."""
    return host_groups(workers, per_leaf)


def rehome(strategy: Any, step: int) -> int:
    """[Note: re-homed groups]: ``strategy`` (a `PSStrategy` worker whose leaf was lost at
    ``step``) joins the root; return its clock, that of its next step at the earliest."""
    layout, servers, scale = strategy.root
    client = WorkerClient(strategy.rank, layout, servers, strategy.num_workers)
    client.reply_timeout_s = strategy.job.launch.timeout_s
    start = client.join()
    for clock in range(start, step + 1):  # empty clocks up to the next step
        client.end_push(clock)
    strategy.client, strategy.layout, strategy.servers = client, layout, servers
    strategy.push_scale, strategy.root = scale, None
    strategy.fresh, strategy.next_pull = -1, None
    return max(start, step + 1)


def leaf_name(index: int) -> str:
    """Leaf ``index``'s heartbeat and stats name."""
    return f"leaf{index}"


def build_leaf(
    job: JobConfig,
    leaves: list[list[int]],
    groups: Sequence[ps_wire.Group],
    layout: ShardLayout,
    root: WorkerClient,
    model: nn.Module,
) -> LeafServer:
    """The leaf of ``root.worker``'s group (of ``leaves``, the groups' ranks; ``groups``, their
    process groups), run by that, its lowest, rank: the group's one-shard ``layout``, the root
    shards through ``root``."""
    index = next(i for i, g in enumerate(leaves) if root.worker in g)
    members = leaves[index]
    assert root.worker == min(members), "a leaf runs on its group's lowest rank"
    num_workers = sum(len(g) for g in leaves)
    root.reply_timeout_s = job.launch.timeout_s
    return LeafServer(
        root=root,
        root_layout=root.layout,
        up_scale=len(leaves) / num_workers,
        index=0,
        label=leaf_name(index),
        layout=layout,
        initial=dict(model.named_parameters()),
        optim=job.optim,
        lr_at=lambda clock: 0.0,  # a leaf makes no optimizer step
        mode="sync",
        staleness=0,
        workers=members,
        spares=[],
        num_worker_slots=num_workers,
        num_pushers=len(members),
        worker_timeout_s=job.ps.worker_timeout_s,
        on_nonfinite=job.train.on_nonfinite,
        group=groups[index],
        local=root.worker,
    )


class LeafServer(ParameterServer):
    """A group's sync server whose update is a push to, and a pull from, the root shards.

    ``root``: the client to the root servers (worker id: this rank); ``root_layout``: their
    shards; ``up_scale``: ``num_leaves / num_workers`` ([Note: leaf servers]). The other
    arguments are `ParameterServer`'s, with ``mode = "sync"`` and a one-shard ``layout``.
    """

    def __init__(
        self, *, root: WorkerClient, root_layout: ShardLayout, up_scale: float, **kw: Any
    ) -> None:
        super().__init__(**kw)
        self.root, self.root_layout, self.up_scale = root, root_layout, up_scale
        self.fresh = -1  # the clock whose parameters the leaf holds
        self.root_floor = 0  # the root's slowest clock at the last grant it gave this leaf
        self.root_staleness: list[int] = []

    def resume_at(self, clock: int) -> None:
        super().resume_at(clock)
        self.fresh = -1

    def finish(self, out_dir: str = "") -> None:
        """Pull the start clock from the root, serve the group until it has left, leave the
        root (leaf 0: take the root's final shards to rank 0), stop."""
        start = self.table.min_clock()
        with self._beating():
            self._refresh(start)
        self._serve(lambda: not self.active)
        posted = self.root.leave(start if self.fresh < 0 else self.fresh)
        if posted is not None:  # leaf 0: the root's coordinator
            with self._beating():
                self._load(self.root.final_params(posted))
            ps_wire.wait_all(self._params_ops(self.coordinator, self.table.min_clock()))
            self._serve(lambda: self.shutdown_received)
        self.receivers.join(timeout_s=1)
        if out_dir:
            self.write_stats(Path(out_dir) / "ps" / f"{self.label}.json")

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        out["ps_leaf_root_staleness"] = float(self.root_staleness[-1] if self.root_staleness else 0)
        return out

    # --- the update: up to the root and back ([Note: leaf servers]) ------------------------

    def _apply_sum(self) -> None:
        assert self.aggregator is not None
        clock = self.aggregator.clock
        self.aggregator.finish()
        torch.mul(self.sum_flat, self.up_scale, out=self.grad_flat)
        views = self.layout.unflatten(self.grad_flat, 0)
        flats = [self.root_layout.flatten(views, s) for s in range(self.root_layout.num_servers)]
        window = self.stats.window(clock)
        window.apply_start = time.perf_counter()
        with self._beating():
            self.root.push(clock, flats)
            self._refresh(clock + 1)
        window.apply_end = time.perf_counter()
        self.sum_flat.zero_()
        self.stats.updates += 1
        self.applied = clock + 1

    def _refresh(self, clock: int) -> None:
        """Pull ``clock`` from the root into this leaf's copy."""
        flats, floors = self.root.pull(clock)
        self._load(flats)
        self.fresh = clock
        self.root_floor = min(floors)
        self.root_staleness.append(clock - self.root_floor)

    @torch.no_grad()
    def _load(self, flats: list[torch.Tensor]) -> None:
        for s, flat in enumerate(flats):
            for name, view in self.root_layout.unflatten(flat, s).items():
                self.params[name].copy_(view)

    def _grant_floor(self, floor: int) -> int:
        """The root's slowest clock: the staleness the group's workers see."""
        return min(floor, self.root_floor)

    @contextlib.contextmanager
    def _beating(self) -> Iterator[None]:
        """Keep this leaf's heartbeat while it waits on the root."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(_BEAT_S):
                ps_wire.heartbeat(self.label)

        thread = threading.Thread(target=beat, name=f"ps-{self.label}-beat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

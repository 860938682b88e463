"""`PSStrategy`: parameter-server training behind the loop's `Strategy` interface.

Ranks: the last ``ps.servers`` ranks of the world are servers, the others workers (worker id =
rank, data replica = rank of ``num_workers``). With ``ps.hierarchical`` the workers of one host
(``ps.ranks_per_host`` consecutive ranks) reduce their gradients first and only the lowest rank
of each host talks to the servers (Rudra, Gupta et al., ICDM 2016). With ``ps.leaves`` each
group of workers has a leaf server on its lowest rank between it and the servers ([Note: leaf
servers] in polytrain.ps.leaf). With ``ps.colocate`` there
are no server ranks: every rank is a worker and ranks ``0 .. ps.servers - 1`` also run a server
on a thread ([Note: colocated servers] in polytrain.ps.local). In sync mode a worker pushes from
backward hooks and pulls into forward pre-hooks ([Note: prioritised overlap] in
polytrain.ps.overlap). A worker's pull, compute and push are `polytrain.ps.worker_step`'s; this
module sets up the ranks and runs the loop's `Strategy` calls. See docs/parameter_server.md.

[Note: server ranks in the loop] The loop calls ``train_step(step)`` on every rank. On a server
it serves pushes and pulls until every live worker has completed ``step + 1`` clocks (workers
run ahead of it in async and ssp; it keeps serving them meanwhile), so the server's per-step
records carry its update and byte rates. ``full_state_dict`` serves until every worker has
left, sends the shard to rank 0 and stops. A server holds no model replica: its ``evaluate``
returns NaN and its loss is NaN; the job's losses are the workers'.

[Note: no world collectives] In async and ssp a worker may die, and every collective over the
world (or over all workers) would then fail on the survivors. So these modes use none after
start-up: losses and validation are each worker's own, and the loop skips its final barrier
(``world_collectives = False``). sync mode (no membership) averages the loss over the workers so
it equals the single-process run's.

[Note: parameter-server checkpoints] In sync mode a server exposes its shard as ``modules``
(`module_of` its parameters, views of its flat buffer) and its optimizer as ``optimizer``, so
the checkpointer's rule "a weight is written by the rank that updates it" makes each server
write its shard and optimizer state; workers hold no optimizer and their replicas lag one
update, so they write only their RNG states. A save after step k runs once every server has
applied clock k - 1 (``serve_until_clock``) and every worker has pushed it, so the saved
state is exactly the state after k updates. On resume the servers load their shards in place
and `resume_at` restarts every clock (servers' tables and aggregator, workers' clocks) at k.
The keys are the model's, so such a checkpoint also resumes under other layouts (plain dp).
Colocated servers are saved the same way from their worker's rank ([Note: colocated
checkpoints] in polytrain.ps.local).
async and ssp are refused (`ps.checks.checkpoint_refusal`, declared as ``checkpointable``):
their workers run ahead of the servers (no consistent cut at a step) and a save is a world
collective, which a dead worker would hang ([Note: no world collectives]).

[Note: parameter-server NaN] A worker ends its step through `core.finish_step` ([Note: one
step contract]): its loss and NaN/Inf-gradient flag are averaged over the workers in sync mode
(every worker takes the same branch) and are its own in async/ssp; the update is the push, and
async/ssp clip each worker's gradient before it (sync clips the global mean on the servers).
A non-finite step still pushes, but a gradient filled with NaN, so every server sees it in the
same update whatever shard held the NaN: with ``train.on_nonfinite = "stop"`` the worker and
every server raise `NonFiniteLossError` naming the step; with ``"skip"`` the servers drop that
update (counted as ``ps_skipped_updates``) and the worker's step is reported skipped. With
``ps.overlap`` (sync) the CLOCK leaves before the all-reduce, so the NaN push comes from the
worker that saw the NaN itself; the other workers' finite pushes do not hide it (a sum with a
NaN is NaN on every server): [Note: pull with the clock] in polytrain.ps.overlap.

[Note: recompute on workers] ``parallel.recompute`` recomputes a worker's blocks in backward
(`core.recompute`, which keeps parameter names), so the shard layout is unchanged.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import torch
from torch import nn

from polytrain.comm import ps_wire
from polytrain.comm.init import new_group
from polytrain.config.job import JobConfig
from polytrain.core.batchnorm import convert_batchnorm
from polytrain.core.compile import apply_compile
from polytrain.core.modules import module_of
from polytrain.core.optim import lr_at
from polytrain.core.recompute import apply_recompute
from polytrain.core.step import StepRules, autocast, finish_step, mean_over
from polytrain.core.strategy import StepOutput, Strategy
from polytrain.data.sampler import Batches
from polytrain.models.base import BlockModel
from polytrain.observe.trace import Tracer
from polytrain.ps.checks import checkpoint_refusal
from polytrain.ps.layout import ShardLayout, build_layout
from polytrain.ps.leaf import (
    LeafServer,
    build_leaf,
    leaf_groups,
    leaf_name,
    leaf_size,
    ranks_per_host,
    rehome,
)
from polytrain.ps.local import ColocatedServer
from polytrain.ps.overlap import GradPusher, ParamFetcher
from polytrain.ps.server import ParameterServer
from polytrain.ps.sharding import host_groups, leader_of
from polytrain.ps.worker import PendingPull, PostedPull, WorkerClient
from polytrain.ps.worker_step import WorkerSteps

__all__ = ["PSStrategy", "server_ranks"]


def server_ranks(world_size: int, num_servers: int) -> list[int]:
    """The server ranks: the last ``num_servers`` ranks of the world."""
    return list(range(world_size - num_servers, world_size))


_MAX_LINK_POINTS = 32


def _measured_link(rank: int, servers: list[int]) -> list[tuple[float, float]]:
    """The p2p curve between rank 0 and a server on another rank, measured now by both
    (`ps_wire.probe_link`) and broadcast, so every rank computes the same chunk size ([Note:
    chunk size from the link] in polytrain.ps.layout)."""
    peer = next((r for r in servers if r != 0), 1)
    points = ps_wire.probe_link(peer, lead=True) if rank == 0 else []
    if rank == peer:
        ps_wire.probe_link(0, lead=False)
    table = torch.zeros(_MAX_LINK_POINTS, 2, dtype=torch.float64)
    for i, point in enumerate(points[:_MAX_LINK_POINTS]):
        table[i] = torch.tensor(point, dtype=torch.float64)
    ps_wire.broadcast(table, 0, ps_wire.world_group())
    return [(float(b), float(t)) for b, t in table.tolist() if b > 0]


class PSStrategy(WorkerSteps, Strategy):
    """One rank of a parameter-server job: a worker or a server (see the module notes)."""

    def __init__(
        self, job: JobConfig, rank: int, world_size: int, model: BlockModel, batches: Batches
    ) -> None:
        ps = job.ps
        self.job, self.rank, self.model, self.batches = job, rank, model, batches
        # [Note: colocated servers] in polytrain.ps.local: the first ps.servers workers serve.
        self.colocate = ps.colocate
        if ps.colocate:
            self.servers, self.num_workers = list(range(ps.servers)), world_size
        else:
            self.servers = server_ranks(world_size, ps.servers)
            self.num_workers = world_size - ps.servers
        workers = list(range(self.num_workers))
        self.is_server = rank in self.servers and not ps.colocate
        self.sync = ps.mode == "sync"
        # Declared capabilities ([Note: no world collectives], [Note: parameter-server
        # checkpoints]); servers hold no replica to evaluate.
        self.world_collectives = self.sync
        self.checkpoint_refusal = checkpoint_refusal(job)
        self.checkpointable = not self.checkpoint_refusal
        self.evaluates = not self.is_server
        # sync: the servers clip the global mean gradient; async/ssp: each worker its own.
        clip = 0.0 if self.sync else job.optim.grad_clip
        self.rules = StepRules(on_nonfinite=job.train.on_nonfinite, grad_clip=clip)
        self.tracer = Tracer(rank, enabled=bool(job.observe.trace))
        extra = f"mode={ps.mode};s={ps.staleness};workers={self.num_workers};h={ps.hierarchical}"
        link = _measured_link(rank, self.servers) if ps.chunk_kb == 0 else []
        self.layout: ShardLayout = build_layout(model, ps.servers, ps.chunk_kb, extra, link)
        per_leaf = leaf_size(job)
        # [Note: leaf servers] in ps.leaf: its workers see their leaf as one server of one shard
        leaf_layout = build_layout(model, 1, ps.chunk_kb, f"{extra};l", link) if per_leaf else None

        # Groups: every rank creates every group, in the same order.
        self.worker_group = new_group(sorted(workers))
        # Colocated: each server talks over its own copy of the world ([Note: colocated
        # servers]); dedicated servers use the default group.
        groups: list[ps_wire.Group] | None = None
        if ps.colocate:
            groups = [new_group(range(world_size)) for _ in self.servers]
        server_group = new_group(sorted(self.servers))
        hosts = host_groups(workers, ranks_per_host(job)) if ps.hierarchical else []
        host_pgs = [new_group(sorted(g)) for g in hosts]
        leaves = leaf_groups(workers, per_leaf) if per_leaf else []
        leaf_pgs = [new_group(sorted(g)) for g in leaves]
        self.host_group: Any = None
        self.leader = rank
        for g, pg in zip(hosts, host_pgs, strict=True):
            if rank in g:
                self.host_group, self.leader = pg, leader_of(g)
        self.reduce = mean_over(self.worker_group) if self.sync else mean_over()
        # The checkpointer's collectives (sync mode): a world group of their own, since the
        # default group carries the servers' point-to-point traffic on receiver threads.
        self.checkpoint_group = new_group(range(world_size))
        pushers = [leader_of(g) for g in hosts or leaves] if hosts or leaves else workers
        spares = workers[self.num_workers - ps.spare_workers :] if ps.spare_workers else []
        # async/ssp leaves: a worker whose leaf dies joins the root itself ([Note: re-homed
        # groups] in ps.leaf), so the root holds every other worker as a spare.
        rehoming = [w for w in workers if w not in pushers] if leaves and not self.sync else []
        self.num_pushers = len(pushers)
        # [Note: gradient scale] in polytrain.ps.shard
        self.push_scale = self.num_pushers / self.num_workers

        self.server: ParameterServer | None = None
        self.colocated: ColocatedServer | None = None
        self.leaf: LeafServer | None = None
        # async/ssp leaves: the root's layout, servers and push scale, for a re-homing worker
        self.root: tuple[ShardLayout, list[int], float] | None = None
        self.client: WorkerClient | None = None
        # Push from backward hooks, pull into forward hooks: sync without host reduction.
        self.overlap = self.sync and ps.overlap and not ps.hierarchical and not self.is_server
        self.pusher: GradPusher | None = None
        self.fetcher: ParamFetcher | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.modules: list[nn.Module] = []
        self._saved_parts: list[nn.Module] = []  # a colocated server's rank: checkpoint_parts
        steps = job.train.steps
        if self.is_server or (ps.colocate and rank in self.servers):
            index = self.servers.index(rank)
            self.server = ParameterServer(
                index=index,
                layout=self.layout,
                initial=dict(model.named_parameters()),
                optim=job.optim,
                lr_at=lambda clock: lr_at(min(clock, steps - 1), job.optim, steps),
                mode=ps.mode,
                staleness=ps.staleness,
                workers=[w for w in pushers if w not in spares],
                spares=[w for w in pushers if w in spares] + rehoming,
                num_worker_slots=self.num_workers,
                num_pushers=self.num_pushers,
                server_group=server_group,
                worker_timeout_s=ps.worker_timeout_s,
                on_nonfinite=job.train.on_nonfinite,
                group=groups[index] if groups else None,
                local=rank if ps.colocate else None,
            )
        if self.is_server:
            assert self.server is not None
            self.optimizer = self.server.optimizer
            # The shard under the model's keys: the checkpointer saves and loads it in place.
            self.modules = [module_of(self.server.params)]
            self.name = f"ps-{ps.mode}-server{index}"
        else:
            if self.sync and job.model.batchnorm == "global":  # [Note: BatchNorm parity]
                convert_batchnorm(model, self.worker_group)
            names = None
            if leaf_layout is not None:  # [Note: leaf servers]: this worker's leaf serves it
                index = next(i for i, g in enumerate(leaves) if rank in g)
                if rank == leader_of(leaves[index]):
                    root = WorkerClient(rank, self.layout, self.servers, self.num_workers)
                    self.leaf = build_leaf(job, leaves, leaf_pgs, leaf_layout, root, model)
                groups, names = [leaf_pgs[index]], [leaf_name(index)]
                if rank in rehoming:
                    self.root = (self.layout, self.servers, self.push_scale)
                self.servers, self.layout = [leader_of(leaves[index])], leaf_layout
                self.push_scale = 1.0  # the leaf scales its group's sum
            local = self.server or self.leaf
            self.client = WorkerClient(
                rank,
                self.layout,
                self.servers,
                self.num_workers,
                job.launch.timeout_s,
                groups=groups,
                local=local.link if local is not None else None,
                names=names,
            )
            if job.parallel.recompute:  # [Note: recompute on workers]
                apply_recompute(model, job.parallel.recompute_policy)
            if job.train.compile:  # the overlap's hooks run around each compiled block
                apply_compile(model)
            if self.overlap:  # [Note: prioritised overlap] in polytrain.ps.overlap
                self.pusher = GradPusher(model, self.layout)
                self.fetcher = ParamFetcher(model, self.layout)
            self.modules = [model]
            kind = "-hier" if ps.hierarchical else "-colocated" if ps.colocate else ""
            kind += f"-{len(leaves)}leaves" if leaves else ""
            self.name = f"ps-{ps.mode}-{ps.servers}s{self.num_workers}w{kind}"
            if self.server is not None:  # colocated: serve on a thread of this rank
                assert self.server.link is not None
                self.colocated = ColocatedServer(self.server, self.server.link, job.observe.out_dir)
                # [Note: colocated checkpoints]: the replica's state, the shard's weights.
                saved = dict(model.state_dict(keep_vars=True))
                saved.update(self.server.params)
                self._saved_parts = [module_of(saved)]
            if self.leaf is not None and self.leaf.link is not None:  # serve on a thread
                self.colocated = ColocatedServer(self.leaf, self.leaf.link, job.observe.out_dir)
        self.is_pusher = rank in pushers or bool(leaves)
        self.joining = rank in spares
        self.straggler = rank == self.num_workers - 1 and ps.straggler_delay_s > 0
        self.clock = 0  # iterations this worker has completed
        self.fresh = -1  # the clock whose parameters the model holds
        # sync overlap: the next clock's pull, posted with this clock's CLOCK ([Note: pull
        # with the clock] in polytrain.ps.overlap)
        self.next_pull: PostedPull | None = None
        self.pending_pull: PendingPull | None = None  # the pull this step's forward takes
        self.started = time.monotonic()
        self.last_metrics: dict[str, float] = {}

    # --- Strategy interface --------------------------------------------------------------

    def set_lr(self, lr: float) -> None:
        """Servers compute each update's learning rate from its clock; nothing to do here."""

    def resume_at(self, step: int) -> None:
        """Called by the checkpointer after a restore: continue at clock ``step``."""
        for server in (self.server, self.leaf):
            if server is not None:
                server.resume_at(step)
        self.clock = step
        self.fresh = -1
        self.next_pull = None

    def checkpoint_parts(self) -> tuple[list[nn.Module], torch.optim.Optimizer | None]:
        """A colocated server's rank saves its shard and optimizer ([Note: colocated
        checkpoints]); they stay out of ``modules`` and ``optimizer``, which the loop reads on
        its own thread (the optimizer steps on the server's)."""
        if self.colocated is not None and self.server is not None:
            return self._saved_parts, self.server.optimizer
        return self.modules, self.optimizer

    def before_save(self, step: int) -> None:
        """A colocated server must have made ``step`` updates ([Note: colocated checkpoints]);
        a leaf holds nothing to save and waits on the root, which is saving."""
        if self.colocated is not None and self.server is not None:
            self.colocated.wait_applied(step)

    def _serve_colocated(self) -> None:
        """Start this rank's colocated server, if any (after a restore), and raise its error."""
        if self.colocated is not None:
            self.colocated.start()
            self.colocated.check()

    def train_step(self, step: int) -> StepOutput:
        if self.root is None:
            return self._train_step(step)
        try:
            return self._train_step(step)
        except (ps_wire.PeerLost, ps_wire.PeerHung) as exc:  # [Note: re-homed groups]
            print(
                f"polytrain: worker rank {self.rank} lost its leaf server at step {step + 1} "
                f"({exc}); it joins the root servers and training continues",
                file=sys.stderr,
                flush=True,
            )
            self.clock = rehome(self, step)
            return StepOutput(loss=math.nan, skipped=True)

    def _train_step(self, step: int) -> StepOutput:
        if self.server is not None and self.is_server:
            with self.tracer.span("serve", cat="communication", step=step):
                self.server.serve_until_clock(step + 1)
            skipped = step in self.server.stats.skipped
            return StepOutput(loss=math.nan, skipped=skipped, metrics=self.server.metrics())
        self._serve_colocated()
        if self.joining:
            self._join()
        if step < self.clock:  # a joined worker skips the clocks the job ran before it came
            return StepOutput(loss=math.nan, skipped=True)
        assert step == self.clock, f"worker at clock {self.clock} asked to run step {step}"
        self._ensure_params(step, lazy=self.overlap)
        loss = self._forward_backward(step)
        if self.straggler:
            time.sleep(self.job.ps.straggler_delay_s)
        self.clock += 1  # the push below completes the clock, also a poisoned one
        if self.pusher is not None:  # [Note: pull with the clock] in polytrain.ps.overlap
            self._post_clock(step, loss)
        out = finish_step(  # [Note: parameter-server NaN]
            step,
            loss,
            self.model.parameters(),
            self.rules,
            reduce=self.reduce,
            update=lambda: self._push(step),
            drop=lambda: self._push(step, poison=True),
        )
        metrics = dict(self.last_metrics)
        local = self.server or self.leaf
        if self.colocated is not None and local is not None:
            metrics.update(local.metrics())
        return StepOutput(loss=out.loss, skipped=out.skipped, metrics=metrics)

    @torch.no_grad()
    def evaluate(self, num_batches: int) -> float:
        """Validation loss of the current parameters on the whole validation batches.

        Every worker evaluates the same batches, so in sync mode (identical parameters) every
        worker gets the same value without a collective; servers return NaN.
        """
        if self.server is not None and self.is_server:
            if self.sync:
                # Grant the workers' evaluation pulls now: in sync mode each worker pulls the
                # current clock once (here or in its next step), and a checkpoint save may
                # follow, a collective the server must not enter while a worker waits on it.
                self.server.serve_until_pulled(self.server.table.min_clock())
            return math.nan
        self._serve_colocated()
        self._ensure_params(self.clock)
        self.model.eval()
        total = 0.0
        for i in range(num_batches):
            x, y = self.batches.val(i)
            with autocast(torch.device("cpu"), self.job.train.dtype):
                total += float(self.model.loss(self.model(x), y))
        return total / num_batches

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Workers leave; servers serve until all have left and send their shards to rank 0."""
        if self.server is not None and self.is_server:
            self.server.finish(self.job.observe.out_dir)
            return {}
        assert self.client is not None
        self._serve_colocated()
        if self.next_pull is not None:  # a pull no step or evaluation used
            self.next_pull.granted().wait_rest()
            self.next_pull = None
        posted = self.client.leave(self.clock) if self.is_pusher else None
        if self.root is not None:  # a spare at the root that never joined it
            layout, servers, _ = self.root
            WorkerClient(self.rank, layout, servers, self.num_workers).leave(self.clock)
        state: dict[str, torch.Tensor] = {}
        if posted is not None:
            state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            for s, flat in enumerate(self.client.final_params(posted)):
                for name, view in self.layout.unflatten(flat, s).items():
                    state[name] = view.clone()
        if self.colocated is not None:  # the server stops at the coordinator's SHUTDOWN
            self.colocated.join()
        return state

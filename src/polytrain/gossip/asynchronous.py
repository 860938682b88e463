"""``gossip.mode = "async"``: gossip in which no rank waits for a peer, and peers may die.

Asynchronous decentralized SGD in the manner of AD-PSGD (Lian et al., "Asynchronous
Decentralized Parallel Stochastic Gradient Descent", ICML 2018): after its local step a worker
hands a copy of its model to its out-neighbours and averages itself with whatever copies have
arrived from its in-neighbours since its last step, without waiting for any
([Note: asynchronous mailboxes] in `polytrain.comm.gossip_async`). A slow peer is mixed in less
often; a stopped one never; a dead one is reported once and forgotten.

[Note: asynchronous mixing] With ``k`` fresh copies ``z_j`` a worker sets
``x <- (x + sum_j z_j) / (1 + k)``: uniform weights over what it has, which are the synchronous
weights of the regular undirected graphs when every neighbour was heard. The copies are as old
as their sender's last step, and rows of this rule sum to 1 but columns need not, so the
replicas reach consensus (on a graph that stays connected) but not exactly the average of the
synchronous rule; push-sum weights are not used. If a death disconnects the graph, the parts
train on apart.

[Note: no world collectives in async gossip] A dead rank would hang every world collective, so
after start-up none is used (``world_collectives = False``, the launcher tolerates the death of
any rank but 0, the family's `tolerated_ranks`): the loss, the NaN/Inf branch and gradient
clipping are each worker's own; the logged loss is rank 0's. ``consensus_distance`` becomes the
local mean distance to the copies that arrived this step (no all-reduce), evaluation runs this
rank's replica on the whole validation batch, and the exported weights are rank 0's replica.
Checkpoints are refused (no consistent cut across ranks that do not meet).
"""

from __future__ import annotations

import sys

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from polytrain.comm.compressors import WIRE_DTYPES
from polytrain.comm.gossip_async import Departure, Mailboxes, with_step
from polytrain.config.job import JobConfig
from polytrain.core.step import mean_over
from polytrain.data.sampler import Batches
from polytrain.gossip.checks import checkpoint_refusal
from polytrain.gossip.graphs import graph_for_round, mixing_matrix, round_plan
from polytrain.gossip.replica import ReplicaStrategy
from polytrain.models.base import BlockModel

__all__ = ["AsyncGossipStrategy"]


class AsyncGossipStrategy(ReplicaStrategy):
    """Local step, hand copies to the out-neighbours, mix in whatever arrived; never wait."""

    world_collectives = False
    checkpointable = False

    def __init__(
        self,
        job: JobConfig,
        model: BlockModel,
        batches: Batches,
        device: torch.device,
        rank: int,
        world_size: int,
    ) -> None:
        super().__init__(job, model, batches, device, rank, world_size)
        g = job.gossip
        self.checkpoint_refusal = checkpoint_refusal(job)
        self.reduce = mean_over()  # [Note: no world collectives in async gossip]
        self.name = f"gossip-async-{g.topology}-w{world_size}"
        if g.compress != "none":
            self.name += f"-{g.compress}"
        self.wire_dtype = WIRE_DTYPES[g.compress]
        self.numel = sum(p.numel() for p in self.params)
        others = [r for r in range(world_size) if r != rank]
        if g.topology == "random":  # anyone may be drawn: a thread to and from everyone
            outs, ins = others, others
        else:
            plan = round_plan(mixing_matrix(graph_for_round(g.topology, world_size, 0)), rank)
            outs, ins = [peer for peer, _ in plan.send], list(plan.recv)
        self.mailboxes = Mailboxes(outs, ins, self.numel, self.wire_dtype)
        self.distance = 0.0
        self.heard = 0

    def _out_peers(self, step: int) -> list[int]:
        g = self.job.gossip
        graph = graph_for_round(g.topology, self.world_size, step, peers=g.peers, seed=g.seed)
        return list(graph.out[self.rank])

    @torch.no_grad()
    def communicate(self, step: int) -> None:
        x = parameters_to_vector(self.params)
        message = with_step(x.to(self.wire_dtype), step)
        for peer in self._out_peers(step):
            self.mailboxes.post(peer, message)
        fresh = [m[: self.numel].to(x.dtype) for m in self.mailboxes.take().values()]
        self.heard = len(fresh)
        self.distance = (
            float(sum(float((x - z).norm()) for z in fresh) / len(fresh)) if fresh else 0.0
        )
        if fresh:  # [Note: asynchronous mixing]
            vector_to_parameters(torch.stack([x, *fresh]).mean(dim=0), self.params)
        for departure in self.mailboxes.departures():
            self._report(departure, step)
        self.bytes_sent += self.mailboxes.sent_bytes()
        if step + 1 == self.job.train.steps:
            self._finish()

    def _finish(self) -> None:
        """Goodbyes, and the wait for this rank's threads ([Note: finished or dead])."""
        waiting = self.mailboxes.finish(self.job.launch.timeout_s)
        if waiting:
            print(
                f"polytrain: rank {self.rank} finished, but rank(s) "
                f"{', '.join(map(str, waiting))} did not say goodbye within launch.timeout_s = "
                f"{self.job.launch.timeout_s:g} s (slow or stopped); leaving without them",
                file=sys.stderr,
                flush=True,
            )
        for departure in self.mailboxes.departures():
            self._report(departure, self.job.train.steps - 1)

    def _report(self, d: Departure, step: int) -> None:
        heard = (
            f"its last copy was of step {d.last_step + 1}" if d.last_step >= 0 else "never heard"
        )
        print(
            f"polytrain: worker rank {d.rank} left {d.seconds:.1f} s into training ({heard}; "
            f"noticed by rank {self.rank} at step {step + 1}); asynchronous gossip continues "
            "without it",
            file=sys.stderr,
            flush=True,
        )

    def extra_metrics(self, step: int) -> dict[str, float]:
        return {"gossip_heard": float(self.heard)}

    # -- no world collectives ([Note: no world collectives in async gossip]) ---------------

    def consensus_distance(self) -> float:
        """Mean distance to the neighbours' copies that arrived this step (0 if none)."""
        return self.distance

    @torch.no_grad()
    def evaluate(self, num_batches: int) -> float:
        return float(self.val_total(num_batches, 0, 1)) / num_batches

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

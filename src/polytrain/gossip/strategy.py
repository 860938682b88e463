"""``sync = "gossip"``: decentralized SGD, a local step then one mixing round with neighbours.

D-PSGD (Lian et al., NeurIPS 2017) on undirected graphs, Stochastic Gradient Push (Assran et
al., ICML 2019) on directed ones ([Note: mixing matrix convention] in `polytrain.gossip.graphs`).
Round ``t`` uses the graph of step ``t``, which every rank computes alone from the topology, the
world size and ``gossip.seed``.

[Note: push-sum on the wire] Where the mixing matrix is not doubly stochastic (random peers),
each replica carries a weight ``w`` and its model is ``z = x / w``. A message is
``[M[i][j] * w * z, M[i][j] * w]`` (one flat tensor, the weight as its last element), the
receiver sums what arrives with its kept share and sets ``z = x / w``. Where the matrix is
doubly stochastic ``w`` stays 1 and is not sent. With ``gossip.compress = fp16/bf16`` the
message travels in that dtype and is summed in fp32.

[Note: CHOCO gossip] Top-k and sign cannot compress the model itself (a receiver would lose
what was left out). With ``gossip.compress = topk/sign`` the graph is fixed and every node keeps
*public copies*: ``h_i`` of its own model and ``h_j`` of each in-neighbour's, equal on every node
that holds them. A round sends ``q_i = C(x_i - h_i)`` (one uint8 message per neighbour), every
holder adds the decoded ``q`` to the copy it belongs to, and the node moves toward its
neighbours' copies: ``x_i <- x_i + gamma * sum_j M[i][j] (h_j - h_i)`` (Koloskova et al.,
"Decentralized Stochastic Optimization and Gossip Algorithms with Compressed Communication",
CHOCO-SGD, ICML 2019; ``gamma = gossip.consensus_lr``). ``x_i - h_i`` is the error feedback: what
a message left out is still there to send next round. At a checkpoint step
(`ReplicaStrategy.synchronize`) every copy is reset to the average, on every node alike.

[Note: overlapped gossip] With ``gossip.overlap`` a round's messages travel while the next
step computes: Overlap SGP with a delay of one round (Assran et al., ICML 2019, Algorithm 2
with ``tau = 1``). Node ``i`` holds a push-sum numerator ``y_i = w_i z_i`` (``z_i`` the
parameters, ``w_i`` the weight; always carried, since the mass in flight makes even a doubly
stochastic matrix leave ``sum_i w_i != n`` between rounds). Round ``t``: the local step moves
the numerator, as SGP's ``x_i <- x_i - lr * g(z_i)``: with ``d_i`` the optimizer's update of
``z_i`` (``-lr * g_i`` for plain SGD), ``y_i = w_i z_i + d_i``; then

    wait for the messages of round t - 1 (posted a step ago, sent while this step computed)
    post  [M[j][i] y_i, M[j][i] w_i] to each out-neighbour j   (non-blocking)
    y_i <- M[i][i] y_i + sum_j m_ij^(t-1),   w_i <- M[i][i] w_i + sum_j mw_ij^(t-1)
    z_i <- y_i / w_i

where ``m_ij^(t-1)`` is what ``j`` pushed to ``i`` in round ``t - 1`` (zero in round 0). (Had
the update moved ``z`` instead, ``y_i = w_i (z_i + d_i)``, the network's average would advance
by ``w_i d_i`` a step: with a quarter to a half of the mass in flight, ``w_i`` settles near
0.6 on a ring of 4 and the learning rate would shrink by as much.) The
next step's forward and backward run on this ``z_i`` while round ``t``'s messages are in
flight, on a process group of their own (so the step's small loss all-reduce is not queued
behind them). Nothing is lost: a message is in flight for exactly one step and the sum of
``y`` and ``w`` over nodes and messages in flight is preserved. At the last step, and before
a checkpoint's average or an export (`settle`), the messages in flight are waited for and added
(``y_i += m``, ``w_i += mw``), so the final replicas hold all the mass. Evaluation between steps
uses the nodes' values without what is in flight.
"""

from __future__ import annotations

import time

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from polytrain.comm.compressors import WIRE_DTYPES, Compressor, build_compressor
from polytrain.comm.gossip_wire import PendingExchange, exchange, start_exchange, wire_group
from polytrain.config.job import JobConfig
from polytrain.data.sampler import Batches
from polytrain.gossip.graphs import (
    RoundPlan,
    graph_for_round,
    is_doubly_stochastic,
    mixing_matrix,
    round_plan,
)
from polytrain.gossip.replica import ReplicaStrategy
from polytrain.models.base import BlockModel

__all__ = ["GossipStrategy"]


class GossipStrategy(ReplicaStrategy):
    """Local step, then push weighted copies to this round's out-neighbours and sum the rest."""

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
        self.name = f"gossip-{g.topology}-w{world_size}"
        if g.topology == "random":
            self.name += f"-k{g.peers}"
        if g.compress != "none":
            self.name += f"-{g.compress}"
        self.overlap = g.overlap  # [Note: overlapped gossip]
        self._pending: PendingExchange | None = None
        self._before: torch.Tensor | None = None  # the parameters before the local step
        # collective (every rank builds the strategy): the overlapped rounds' own group
        self._wire_group = wire_group() if self.overlap else None
        if self.overlap:
            self.name += "-overlap"
        self.wait_s = 0.0  # seconds this step spent blocked on the exchange
        self.wire_dtype = WIRE_DTYPES.get(g.compress, torch.float32)
        self._fixed: tuple[RoundPlan, bool] | None = None
        if g.topology != "random":  # the same graph every round: plan it once
            self._fixed = self._plan(0)
        self.compressor: Compressor | None = None
        if g.compress in ("topk", "sign") and self._fixed is not None:  # [Note: CHOCO gossip]
            segments = [p.numel() for p in self.params]
            self.compressor = build_compressor(g.compress, segments, g.topk_ratio)
            m = mixing_matrix(graph_for_round(g.topology, world_size, 0))
            self.in_weights = {j: m[rank][j] for j in self._fixed[0].recv}  # M[i][j]
            self._reset_copies()

    def _reset_copies(self) -> None:
        """Every public copy = this replica (equal on all nodes at the start and after
        `synchronize`)."""
        assert self._fixed is not None
        x = parameters_to_vector(self.params).detach().float()
        self.own_copy = x.clone()
        self.copies = {peer: x.clone() for peer in self._fixed[0].recv}

    def _plan(self, step: int) -> tuple[RoundPlan, bool]:
        """This rank's part of round ``step`` and whether it needs push-sum weights.

        Random peers always carry the weight: a round that happens to be doubly stochastic (a
        permutation) must still move the weights the earlier rounds made unequal.
        """
        g = self.job.gossip
        graph = graph_for_round(g.topology, self.world_size, step, peers=g.peers, seed=g.seed)
        m = mixing_matrix(graph)
        push_sum = g.topology == "random" or not is_doubly_stochastic(m)
        return round_plan(m, self.rank), push_sum

    @torch.no_grad()
    def communicate(self, step: int) -> None:
        self.wait_s = 0.0
        if self.compressor is not None:
            self._choco_round()
            return
        plan, push_sum = self._fixed or self._plan(step)
        if self.overlap:
            self._overlapped_round(step, plan)
            return
        z = parameters_to_vector(self.params)
        x = z * self.weight
        if push_sum:  # [Note: push-sum on the wire]
            x = torch.cat([x, x.new_tensor([self.weight])])
        sends = [(peer, (x * share).to(self.wire_dtype)) for peer, share in plan.send]
        recvs = [(peer, torch.empty_like(x, dtype=self.wire_dtype)) for peer in plan.recv]
        start = time.perf_counter()
        self.bytes_sent += exchange(sends, recvs)
        self.wait_s += time.perf_counter() - start
        mixed = x * plan.keep
        for _, buffer in recvs:
            mixed += buffer.float()
        if push_sum:
            self.weight = float(mixed[-1])
            mixed = mixed[:-1] / self.weight
        vector_to_parameters(mixed.to(z.dtype), self.params)

    def _numerator(self) -> tuple[torch.Tensor, torch.dtype]:
        """``[w z, w]`` of this replica (fp32 math as in the blocking mode) and ``z``'s dtype."""
        z = parameters_to_vector(self.params)
        x = z * self.weight
        return torch.cat([x, x.new_tensor([self.weight])]), z.dtype

    def _set_numerator(self, x: torch.Tensor, dtype: torch.dtype) -> None:
        self.weight = float(x[-1])
        vector_to_parameters((x[:-1] / self.weight).to(dtype), self.params)

    def _wait_pending(self) -> list[tuple[int, torch.Tensor]]:
        if self._pending is None:
            return []
        start = time.perf_counter()
        arrived = self._pending.wait()
        self.wait_s += time.perf_counter() - start
        self._pending = None
        return arrived

    def before_local_step(self) -> None:
        if self.overlap:  # the update moves the numerator ([Note: overlapped gossip])
            self._before = parameters_to_vector(self.params).detach()

    @torch.no_grad()
    def _overlapped_round(self, step: int, plan: RoundPlan) -> None:
        """[Note: overlapped gossip]: mix in last round's messages, post this round's."""
        z = parameters_to_vector(self.params)
        before = z if self._before is None else self._before
        y = before * self.weight + (z - before)  # w z_before + d
        x, dtype = torch.cat([y, y.new_tensor([self.weight])]), z.dtype
        self._before = None
        arrived = self._wait_pending()  # at most one exchange in flight
        sends = [(peer, (x * share).to(self.wire_dtype)) for peer, share in plan.send]
        recvs = [(peer, torch.empty_like(x, dtype=self.wire_dtype)) for peer in plan.recv]
        self._pending = start_exchange(sends, recvs, self._wire_group)
        self.bytes_sent += self._pending.bytes_sent
        mixed = x * plan.keep
        for _, buffer in arrived:
            mixed += buffer.float()
        self._set_numerator(mixed, dtype)
        if step + 1 == self.job.train.steps:
            self.settle()

    @torch.no_grad()
    def settle(self) -> None:
        """Wait for the round in flight and add its messages ([Note: overlapped gossip])."""
        arrived = self._wait_pending()
        if not arrived:
            return
        x, dtype = self._numerator()
        for _, buffer in arrived:
            x += buffer.float()
        self._set_numerator(x, dtype)

    @torch.no_grad()
    def _choco_round(self) -> None:
        """[Note: CHOCO gossip]: send ``C(x - h_own)``, update the copies, step toward them."""
        assert self.compressor is not None and self._fixed is not None
        plan = self._fixed[0]
        z = parameters_to_vector(self.params)
        x = z.detach().float()
        packet = self.compressor.encode(x - self.own_copy)
        self.own_copy += self.compressor.decode(packet)
        message = packet.to_bytes()
        sends = [(peer, message) for peer, _ in plan.send]
        recvs = [(peer, torch.empty_like(message)) for peer in plan.recv]
        start = time.perf_counter()
        self.bytes_sent += exchange(sends, recvs)
        self.wait_s += time.perf_counter() - start
        pull = torch.zeros_like(x)
        for peer, buffer in recvs:
            self.copies[peer] += self.compressor.decode(packet.like(buffer))
            pull += self.in_weights[peer] * (self.copies[peer] - self.own_copy)
        gamma = self.job.gossip.consensus_lr
        vector_to_parameters((x + gamma * pull).to(z.dtype), self.params)

    def after_synchronize(self) -> None:
        if self.compressor is not None:
            self._reset_copies()

    def extra_metrics(self, step: int) -> dict[str, float]:
        out = {"exchange_wait_s": self.wait_s}
        if self.job.gossip.topology == "random" or self.overlap:
            out["push_sum_weight"] = self.weight
        return out

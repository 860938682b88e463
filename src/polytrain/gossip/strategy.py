"""``sync = "gossip"``: decentralized SGD, a local step then one mixing round with neighbours.

D-PSGD (Lian et al., NeurIPS 2017) on undirected graphs, Stochastic Gradient Push (Assran et
al., ICML 2019) on directed ones ([Note: mixing matrix convention] in `polytrain.gossip.graphs`).
Round ``t`` uses the graph of step ``t``, which every rank computes alone from the topology, the
world size and ``gossip.seed``.

[Note: push-sum on the wire] Where the mixing matrix is not doubly stochastic (random peers),
each replica carries a weight ``w`` and its model is ``z = x / w``. A message is
``[M[i][j] * w * z, M[i][j] * w]`` (one flat tensor, the weight as its last element), the
receiver sums what arrives with its kept share and sets ``z = x / w``. Where the matrix is
doubly stochastic ``w`` stays 1 and is not sent. With ``gossip.compress`` the message travels in
fp16/bf16 and is summed in fp32.
"""

from __future__ import annotations

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from polytrain.comm.gossip_wire import exchange
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

_WIRE = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


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
        self.wire_dtype = _WIRE[g.compress]
        self._fixed: tuple[RoundPlan, bool] | None = None
        if g.topology != "random":  # the same graph every round: plan it once
            self._fixed = self._plan(0)

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
        plan, push_sum = self._fixed or self._plan(step)
        z = parameters_to_vector(self.params)
        x = z * self.weight
        if push_sum:  # [Note: push-sum on the wire]
            x = torch.cat([x, x.new_tensor([self.weight])])
        sends = [(peer, (x * share).to(self.wire_dtype)) for peer, share in plan.send]
        recvs = [(peer, torch.empty_like(x, dtype=self.wire_dtype)) for peer in plan.recv]
        self.bytes_sent += exchange(sends, recvs)
        mixed = x * plan.keep
        for _, buffer in recvs:
            mixed += buffer.float()
        if push_sum:
            self.weight = float(mixed[-1])
            mixed = mixed[:-1] / self.weight
        vector_to_parameters(mixed.to(z.dtype), self.params)

    def extra_metrics(self, step: int) -> dict[str, float]:
        return {"push_sum_weight": self.weight} if self.job.gossip.topology == "random" else {}

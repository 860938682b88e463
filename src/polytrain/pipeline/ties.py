"""Parameters tied across pipeline ranks ([Note: layer pipeline] in `models.split`): one tensor
used by stages on different ranks (GPT-2's token embedding on the first stage and its output
head on the last) is held by each of those ranks. After the flush the copies' gradients are
summed over a process group of the holding ranks, so every copy takes the same update, and the
global gradient norm counts the tensor once, on the first rank holding it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from polytrain.comm.collectives import all_reduce_sum_
from polytrain.comm.mesh import Mesh
from polytrain.comm.p2p import new_group_or_none
from polytrain.core.tensor_parallel import like_param, local_tensor

__all__ = ["CrossRankTies"]


class CrossRankTies:
    """This rank's parameters tied to other pipeline ranks' (none by default)."""

    def __init__(self) -> None:
        self.group: Any = None  # the holding ranks' process group, if this rank holds a tie
        self.params: list[nn.Parameter] = []
        self.names: list[str] = []
        self.counted = True  # whether this rank counts the tied tensors in the global norm

    @classmethod
    def of(
        cls,
        ties: list[tuple[nn.Parameter, tuple[int, ...]]],
        names: list[str],
        stage: nn.Module,
        mesh: Mesh,
    ) -> CrossRankTies:
        """A process group per set of pipeline ranks sharing tensors (every rank creates every
        one); this rank's tied parameters by name (tensor parallel replaced them by DTensors)."""
        out = cls()
        pp_rank = mesh.coord("pp")
        pp_groups = mesh.dims.all_groups("pp")
        for ranks in sorted({ranks for _, ranks in ties}):
            group = new_group_or_none([[g[r] for r in ranks] for g in pp_groups], mesh.rank)
            if pp_rank in ranks:
                assert out.group is None, "one set of ranks per model is supported"
                out.group = group
                out.counted = pp_rank == ranks[0]
        out.names = names
        out.refind(stage)
        return out

    def refind(self, stage: nn.Module) -> None:
        """Find the tied parameters of ``stage`` again by name (FSDP2 replaces them)."""
        params = dict(stage.named_parameters())
        self.params = [params[name] for name in self.names]

    def sum_grads(self) -> None:
        """Collective over the holding ranks: every tied copy's gradient becomes their sum."""
        if self.group is None:
            return
        for param in self.params:
            if param.grad is not None:  # a tp shard pairs with the same shard (same tp rank)
                param.grad = like_param(param.grad, param)
                all_reduce_sum_(local_tensor(param.grad), self.group)

    def counted_in_norm(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``grads`` without the tied tensors' where another rank counts them in the norm."""
        if self.counted:
            return list(grads)
        tied = {id(p.grad) for p in self.params}
        return [g for g in grads if id(g) not in tied]

"""ZeRO inside pipeline stages: FSDP2 over each stage's data-parallel replicas.

ZeRO (Rajbhandari et al., SC 2020) through FSDP2's ``fully_shard`` (`core.fsdp`), composed
with a synchronous pipeline (GPipe, 1F1B, interleaved 1F1B) as torchtitan composes them: each
rank shards each of its stages' blocks, then the stage, over the stage's ``dp`` sub-mesh (the
same stage of every pipeline replica). The optimizer is built on the sharded parameters, so it steps on the
DTensor shards and keeps its state sharded.

[Note: ZeRO inside stages] A stage runs one backward per micro-batch, and FSDP2 would
reduce-scatter the gradients after each of them (m collectives per step). Before each ``B``
the runtime calls `StageSharding.before_backward` (the schedule is data, so the stage's last
backward of the step is known in advance), which tells FSDP2 whether this backward is the
step's last on the stage:

- every backward but the last: ``set_requires_gradient_sync(False)``; FSDP2 accumulates the
  *unsharded* gradient of each parameter across micro-batches (a full gradient of the stage
  is held during the step, as torch.distributed.pipelining's stages hold it);
- the last: ``set_requires_gradient_sync(True)``, so FSDP2 reduce-scatters the accumulated
  gradient once (averaged over ``dp``), and reshards.

Parameters, per stage: ``zero = 3`` (``reshard_after_forward=True`` and reshard after every
backward) gathers the stage's blocks for each micro-batch's forward and again for its backward,
2m all-gathers per step, holding one block's full weights at a time. ``zero = 2`` gathers them
once, at the step's first forward, and keeps them whole until the step's last backward
(``reshard_after_forward=False`` and ``set_reshard_after_backward`` False until then): one
all-gather per step, the whole stage resident during the step. Between steps both hold only
their shard of the parameters, gradients and optimizer state. ``set_is_last_backward`` follows
the same flag, so FSDP2 finalizes its state once per step, as torch's ``PipelineStage`` does
(``backward_maybe_with_nosync`` and ``perform_reduce_grad`` in
``torch/distributed/pipelining/stage.py``, which calls FSDP2's private post-backward instead;
here the public switches suffice because the last backward itself reduces).

[Note: backward prefetch in stages] By default FSDP2 prefetches, in a block's backward, the
block whose forward ran before it in the recorded order of forwards, which it clears only at
the last backward. Under 1F1B that order interleaves micro-batches, so the stage's first block
would prefetch the stage's last block of an earlier micro-batch, at the step's last backward
after it was resharded: one wasted all-gather per step (counted in
tests/distributed/test_pipeline_zero.py). Each block's prefetch is therefore set explicitly to
the block before it in the stage; the first block names itself, a no-op (an explicit list
replaces the default, an empty one does not).

The global gradient norm for clipping sums each rank's squared shard norms over ``dp`` (each
shard counted once), then over ``pp`` (`PipelineStrategy._global_norm`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from polytrain.comm.collectives import all_reduce_sum_
from polytrain.comm.mesh import Mesh
from polytrain.config.job import ParallelConfig
from polytrain.core.fsdp import shard_units
from polytrain.models.base import BlockModel
from polytrain.pipeline.schedule import Action, last_backwards
from polytrain.pipeline.stage import StageModule

if TYPE_CHECKING:  # [Note: lazy torch.distributed] in _lazy_dist.py
    from torch.distributed.fsdp import FSDPModule

__all__ = ["StageSharding"]


class StageSharding:
    """FSDP2 on one rank's stage over its ``dp`` peers, reducing once per step
    ([Note: ZeRO inside stages])."""

    def __init__(
        self,
        stages: Mapping[int, tuple[nn.Module, Sequence[nn.Module]]],
        mesh: Mesh,
        cfg: ParallelConfig,
        device: torch.device,
    ) -> None:
        """``stages``: stage index -> (its module, its units): a `StageModule`'s blocks, or a
        user model's repeated layers (a `LayerStage`'s; those the stage does not own hold no
        parameters and stay whole). Each stage is its own FSDP2 root (interleaved 1F1B holds
        several on one rank)."""
        from torch.distributed.fsdp import FSDPModule

        self.zero, self.device = cfg.zero, device
        self.group = mesh.group("dp")
        self.modules: dict[int, FSDPModule] = {}
        for index, (stage, units) in stages.items():
            self.modules[index] = shard_units(stage, units, mesh.sub("dp"), cfg)
            sharded = [u for u in units if isinstance(u, FSDPModule)]
            for k, unit in enumerate(sharded):  # [Note: backward prefetch in stages]
                unit.set_modules_to_backward_prefetch([sharded[k - 1] if k else unit])
        self.last: dict[int, int] = {}
        """Stage -> micro-batch of its last backward in one run of the program (`track`)."""
        self.final_run = True
        """Whether the program's run is the step's last (``train.grad_accum`` runs it k times)."""

    @classmethod
    def of(
        cls,
        stages: Mapping[int, nn.Module],
        model: BlockModel,
        mesh: Mesh,
        cfg: ParallelConfig,
        device: torch.device,
    ) -> StageSharding:
        """Shard a rank's stages: a `StageModule` by its blocks, a `LayerStage` by the model's
        repeated layers."""
        units = {
            index: list(stage.blocks.values()) if isinstance(stage, StageModule) else model.units()
            for index, stage in stages.items()
        }
        return cls({i: (stage, units[i]) for i, stage in stages.items()}, mesh, cfg, device)

    def track(self, program: Sequence[Action]) -> None:
        """The rank's program, run once per step (or once per accumulation round)."""
        self.last = last_backwards(program)

    def before_backward(self, stage_index: int, microbatch: int) -> None:
        """Reduce-scatter (and reshard) after this backward only if it is the step's last."""
        last = self.final_run and self.last.get(stage_index) == microbatch
        module = self.modules[stage_index]
        module.set_is_last_backward(last)
        module.set_requires_gradient_sync(last)
        module.set_reshard_after_backward(last or self.zero == 3)

    def reshard(self) -> None:
        """Free the gathered parameters (``zero = 2`` keeps them after an evaluation)."""
        for module in self.modules.values():
            module.reshard()

    def square_sum(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """Sum of squares of the stage's whole gradients: the shards' summed over ``dp``."""
        from torch.distributed.tensor import DTensor

        local = [(g.to_local() if isinstance(g, DTensor) else g).detach() for g in grads]
        if local:
            square = torch.nn.utils.get_total_norm(local).to(self.device, torch.float32).square()
        else:
            square = torch.zeros((), dtype=torch.float32, device=self.device)
        return all_reduce_sum_(square, self.group)

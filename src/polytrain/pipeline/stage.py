"""One pipeline stage: a contiguous run of a `BlockModel`'s blocks, keyed by their original index.

GPipe (Huang et al. 2019) cuts the layer sequence into stages; this module holds one of them.
Parameter names stay the unwrapped model's (``blocks.<i>....``): the blocks live in an
``nn.ModuleDict`` keyed by ``str(i)``, so ``state_dict()`` of stage ``[3, 5)`` has exactly the
keys ``blocks.3...`` and ``blocks.4...`` of the full model. Checkpoints and exports need nothing
else.

Re-materialization (GPipe section 2.2; Chen et al. 2016) is optional per stage: each block with
parameters runs under a non-reentrant ``torch.utils.checkpoint``, keeping only its input.
``forward`` may also run on a given set of weights instead of the live ones (``weights``), which
is how PipeDream's weight stashing reuses an older version; recomputation then re-runs on the
same stashed tensors, because the checkpointed function closes over them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial

import torch
from torch import nn
from torch.func import functional_call

from polytrain.config.parallel import RecomputePolicy
from polytrain.core.recompute import checkpointed_call
from polytrain.errors import PartitionError
from polytrain.models.base import BlockModel

__all__ = ["StageModule", "build_stage"]

NO_RECOMPUTE = RecomputePolicy()


class StageModule(nn.Module):
    """Blocks ``[start, stop)`` of a model; ``state_dict`` keys are the full model's."""

    def __init__(
        self, blocks: Mapping[int, nn.Module], recompute: RecomputePolicy = NO_RECOMPUTE
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({str(i): block for i, block in sorted(blocks.items())})
        self.recompute = recompute  # which blocks (by their index in the model) and how

    def forward(
        self, x: torch.Tensor, weights: Mapping[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Run the blocks in order; ``weights`` (``named_parameters`` keys) replaces the live ones."""
        for key, block in self.blocks.items():
            fn: Callable[[torch.Tensor], torch.Tensor] = block
            if weights is not None:
                prefix = f"blocks.{key}."
                local = {n[len(prefix) :]: t for n, t in weights.items() if n.startswith(prefix)}
                fn = partial(_call, block, local)
            if self.recompute.covers(int(key)) and self.training and _has_parameters(block):
                x = checkpointed_call(fn, self.recompute.mode == "ops", x)
            else:
                x = fn(x)
        return x


def _call(block: nn.Module, weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    out = functional_call(block, weights, (x,))
    assert isinstance(out, torch.Tensor)
    return out


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def build_stage(
    model: BlockModel, start: int, stop: int, *, recompute: RecomputePolicy = NO_RECOMPUTE
) -> StageModule:
    """The stage holding blocks ``[start, stop)`` of ``model`` (the modules are shared, not copied)."""
    if not 0 <= start < stop <= model.num_blocks:
        raise PartitionError(
            f"stage blocks [{start}, {stop}) are outside the model's {model.num_blocks} blocks"
        )
    return StageModule({i: model.blocks[i] for i in range(start, stop)}, recompute=recompute)

"""Activation recomputation (re-materialisation; Chen et al. 2016, used by GPipe).

Each block's forward runs without keeping its intermediate activations; backward runs it again.
Memory per block drops from its activations to its input, for about one extra forward.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from polytrain.models.base import BlockModel

__all__ = ["apply_recompute"]


def apply_recompute(model: BlockModel) -> BlockModel:
    """Wrap every block with parameters in a non-reentrant checkpoint, in place."""
    for i, block in enumerate(model.blocks):
        if any(True for _ in block.parameters()):
            model.blocks[i] = checkpoint_wrapper(block, preserve_rng_state=True)
    return model


def unwrap_name(name: str) -> str:
    """Parameter name without the checkpoint wrapper's prefix."""
    return name.replace("._checkpoint_wrapped_module", "")


def is_wrapped(module: nn.Module) -> bool:
    return any("_checkpoint_wrapped_module" in n for n, _ in module.named_modules())

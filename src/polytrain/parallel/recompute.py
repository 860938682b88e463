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
    """Wrap every block with parameters in a non-reentrant checkpoint, in place.

    A user model's blocks are its repeated layers ([Note: block view] in `models.blocks`).
    """
    root = model.blocks[0] if model.layers else model.blocks
    names = model.layers if model.layers else [str(i) for i in range(len(model.blocks))]
    for name in names:
        block = root.get_submodule(name)
        if any(True for _ in block.parameters()):
            parent, _, leaf = name.rpartition(".")
            root.get_submodule(parent).register_module(
                leaf, checkpoint_wrapper(block, preserve_rng_state=True)
            )
    return model


def unwrap_name(name: str) -> str:
    """Parameter name without the checkpoint wrapper's prefix."""
    return name.replace("._checkpoint_wrapped_module", "")


def is_wrapped(module: nn.Module) -> bool:
    return any("_checkpoint_wrapped_module" in n for n, _ in module.named_modules())

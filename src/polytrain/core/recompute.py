"""Activation recomputation (re-materialisation; Chen et al. 2016, used by GPipe).

Each block's forward runs without keeping its intermediate activations; backward runs it again.
Memory per block drops from its activations to its input, for about one extra forward.

[Note: recomputation keeps parameter names] The block is not wrapped in another module: its
``forward`` is replaced, on the instance, by a non-reentrant ``torch.utils.checkpoint`` of the
class's own forward. Parameter names, ``state_dict`` keys, checkpoints and exports stay those of
the unwrapped model, and hooks that FSDP2 or tensor parallel register on the block still run
around the checkpointed call. (torch's ``checkpoint_wrapper`` lives in a private package and
inserts a ``_checkpoint_wrapped_module`` level into every name.)
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from polytrain.models.base import BlockModel

__all__ = ["apply_recompute", "is_recomputed"]


def _checkpointed(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = type(block).forward.__get__(block)  # the class's forward, not this wrapper
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def apply_recompute(model: BlockModel) -> BlockModel:
    """Recompute every block with parameters in backward, in place (names unchanged).

    A user model's blocks are its repeated layers ([Note: block view] in `models.blocks`).
    """
    for block in model.units():
        if any(True for _ in block.parameters()) and not is_recomputed(block):
            # A partial over the module (not a closure): deep copies re-bind to the copy.
            block.forward = partial(_checkpointed, block)
    return model


def is_recomputed(block: nn.Module) -> bool:
    forward = block.__dict__.get("forward")
    return isinstance(forward, partial) and forward.func is _checkpointed

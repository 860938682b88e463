"""Activation recomputation (re-materialisation; Chen et al. 2016, used by GPipe).

Each block's forward runs without keeping its intermediate activations; backward runs it again.
Memory per block drops from its activations to its input, for about one extra forward. The
policy (`config.parallel.RecomputePolicy`, from ``parallel.recompute``) picks the blocks (all,
or every K-th) and how much of each is recomputed: the whole forward, or, selectively, only the
element-wise ops between the matmuls and attention, whose outputs are kept ([Note: selective
recomputation]).

[Note: recomputation keeps parameter names] The block is not wrapped in another module: its
``forward`` is replaced, on the instance, by a non-reentrant ``torch.utils.checkpoint`` of the
class's own forward. Parameter names, ``state_dict`` keys, checkpoints and exports stay those of
the unwrapped model, and hooks that FSDP2 or tensor parallel register on the block still run
around the checkpointed call. (torch's ``checkpoint_wrapper`` lives in a private package and
inserts a ``_checkpoint_wrapped_module`` level into every name.)
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from polytrain._torch_private import attention_ops
from polytrain.config.parallel import RecomputePolicy
from polytrain.models.base import BlockModel

__all__ = ["FULL", "apply_recompute", "checkpointed_call", "is_recomputed", "ops_policy"]

FULL = RecomputePolicy("full")

# [Note: selective recomputation]
# "ops" keeps what is expensive to recompute and cheap to hold relative to it: the outputs of
# matrix multiplications and of fused attention (Korthikanti et al., "Reducing Activation
# Recomputation in Large Transformer Models", 2022, section 5; torchtitan's op-level selective
# checkpointing keeps the same kinds of op). Everything else a block saves for backward
# (layer norms, GELU, dropout masks, adds, reshapes) is recomputed from the kept tensors in
# backward. torch's selective checkpoint decides per op through a policy function; the set
# below is matched on the op's overload packet, so every overload counts.
_KEEP = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    *attention_ops(),
}


def ops_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The "ops" policy's decision for one operator (what the planner's statistics count too:
    [Note: selective recomputation's statistics] in measure/ops_stats.py)."""
    return CheckpointPolicy.MUST_SAVE if op in _KEEP else CheckpointPolicy.PREFER_RECOMPUTE


def _contexts() -> Any:
    return create_selective_checkpoint_contexts(ops_policy)


def checkpointed_call(fn: Callable[..., Any], ops: bool, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` under a non-reentrant checkpoint: whole (``ops`` False) or
    keeping matmul and attention outputs ([Note: selective recomputation])."""
    if ops:
        kwargs["context_fn"] = _contexts
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def _checkpointed(block: nn.Module, ops: bool, *args: Any, **kwargs: Any) -> Any:
    forward = type(block).forward.__get__(block)  # the class's forward, not this wrapper
    return checkpointed_call(forward, ops, *args, **kwargs)


def apply_recompute(model: BlockModel, policy: RecomputePolicy = FULL) -> BlockModel:
    """Recompute the blocks ``policy`` covers (those with parameters), in place, names
    unchanged. A user model's blocks are its repeated layers ([Note: block view] in
    `models.blocks`); ``every:K`` counts them from 0."""
    recomputed = False
    for index, block in enumerate(model.units()):
        if not policy.covers(index) or is_recomputed(block):
            continue
        if any(True for _ in block.parameters()):
            # A partial over the module (not a closure): deep copies re-bind to the copy.
            block.forward = partial(_checkpointed, block, policy.mode == "ops")
            recomputed = True
    if recomputed:
        _no_key_value_cache(model)
    return model


def _no_key_value_cache(model: nn.Module) -> None:
    """[Note: no key-value cache under recomputation] A transformers model caches each layer's
    keys and values by default (``config.use_cache``), growing the cache in place in every
    layer's forward. A recomputed layer runs its forward again in backward and would grow it
    again: torch's selective checkpoint then finds another op sequence than the forward's
    ("aten.slice.Tensor ... not found in storage"). Training reads no cache, so it is turned
    off where a layer recomputes, as transformers' own gradient checkpointing does."""
    for module in model.modules():
        config: Any = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True:
            config.use_cache = False


def is_recomputed(block: nn.Module) -> bool:
    forward = block.__dict__.get("forward")
    return isinstance(forward, partial) and forward.func is _checkpointed

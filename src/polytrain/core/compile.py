"""``train.compile``: `torch.compile` (TorchDynamo + Inductor) per repeated block.

Each unit (`BlockModel.units`: a built-in's blocks, a user model's repeated layers) is compiled
on its own, after tensor parallelism and recomputation and before data parallelism or ZeRO
(torchtitan's order): FSDP2, DDP and pipeline stages then hold compiled blocks, and the
compiled graph of one block serves every block of the same shape (one compilation, not one
per layer).

[Note: compile keeps parameter names] As `core.recompute` does, the block is not wrapped:
its ``forward`` is replaced, on the instance, by the compiled form of the forward it has (the
class's own, or recomputation's checkpointed one, which Dynamo traces as one region). Names,
``state_dict`` keys, checkpoints and exports stay those of the unwrapped model
(``torch.compile(module)`` would add an ``_orig_mod`` level), and the hooks that FSDP2 and
DDP register on the block run eagerly around the compiled call, as they do around
torchtitan's compiled blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from polytrain.models.base import BlockModel

__all__ = ["apply_compile", "is_compiled"]

_COMPILED = "_polytrain_compiled"  # marks a block whose forward is compiled (ours, not torch's)


def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """One compiled function per function (a class's forward, recomputation's wrapper), shared
    by every block that runs it."""
    if fn not in _CACHE:
        _CACHE[fn] = torch.compile(fn)
    return _CACHE[fn]


_CACHE: dict[Callable[..., Any], Callable[..., Any]] = {}


def apply_compile(model: BlockModel) -> BlockModel:
    """Compile every block with parameters of ``model`` (its repeated layers for a user model,
    [Note: block view] in `models.blocks`), in place ([Note: compile keeps parameter names])."""
    for unit in model.units():
        if not any(True for _ in unit.parameters()) or is_compiled(unit):
            continue
        # The forward it has now: the class's own, recomputation's partial, or one a user's
        # library set on the instance. The first two stay partials over the module (not bound
        # methods or closures): deep copies re-bind to the copy, as recomputation's do.
        current = unit.__dict__.get("forward")
        if current is None:
            unit.forward = partial(_compiled(type(unit).forward), unit)
        elif isinstance(current, partial):
            unit.forward = partial(_compiled(current.func), *current.args, **current.keywords)
        else:
            unit.forward = torch.compile(current)
        setattr(unit, _COMPILED, True)
    return model


def is_compiled(module: nn.Module) -> bool:
    return bool(module.__dict__.get(_COMPILED, False))

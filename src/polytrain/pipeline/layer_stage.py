"""A pipeline stage of a user's model cut at its repeated layers ([Note: layer pipeline]).

The stage runs the model's *own* forward, so whatever the model computes between its layers
(causal and padding masks, rotary tables, position ids) is computed exactly as in one process:
the layer list is swapped for the stage's slice ``[a, b)`` for the call, the received hidden
state replaces the first layer's input (a forward pre-hook), and the forward stops after the
last layer of the slice (a forward hook raising `_StageExit`), whose output is sent on. The last
stage runs to the model's output (logits or a ``ModelOutput``), which the loss takes.

Every stage needs the micro-batch's own inputs (``input_ids``, ``attention_mask``...) for that
forward: the runtime hands them over with ``set_context`` (the data is deterministic on every
rank, contract 1). Parts before the slice still run (embeddings on later stages) but their
output is replaced, so they receive no gradient; stages do not train what they do not own
(`models.split.keep_owned`).

[Note: several layer stages per rank] Interleaved 1F1B and ZBV give a rank several slices of
the layers (``build_layer_stages``). They are several `LayerStage` modules over the rank's one
copy of the model, which keeps every entry any of its stages owns: each module's
``parameters()`` and ``state_dict`` are the rank's whole share, each forward runs its own slice.
A tie whose stages all sit on one rank (GPT-2's ``wte`` under ZBV, the V putting the first and
the last stage on rank 0) is one Parameter used by both stages' graphs, so autograd sums its
gradient; only ties across ranks are summed by the pipeline (`cross_rank_ties`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from polytrain.models.base import BlockModel
from polytrain.models.split import LayerSplit, keep_owned

__all__ = ["LayerStage", "build_layer_stages", "cross_rank_ties"]


class _StageExit(Exception):
    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


def _hidden(output: Any) -> torch.Tensor:
    hidden = output if isinstance(output, torch.Tensor) else output[0]
    assert isinstance(hidden, torch.Tensor)
    return hidden


class LayerStage(nn.Module):
    """Layers ``[start, stop)`` of a one-block `BlockModel`; ``state_dict`` keys are the model's."""

    def __init__(
        self,
        model: BlockModel,
        split: LayerSplit,
        ranges: list[tuple[int, int]],
        stage_index: int,
        owned: Collection[int] | None = None,
    ) -> None:
        """``owned``: the stages whose entries the rank keeps (default: this one)."""
        super().__init__()
        self.blocks = model.blocks  # keys stay "blocks.0.<user's names>"
        self.split = split
        self.start, self.stop = ranges[stage_index]
        self.first = stage_index == 0
        self.last = stage_index == len(ranges) - 1
        self._context: Any = None
        keep_owned(self.blocks[0], split, ranges, {stage_index} if owned is None else owned)

    def set_context(self, inputs: Any) -> None:
        """The current micro-batch's model inputs (one tensor or named tensors)."""
        self._context = inputs

    def forward(self, x: torch.Tensor, weights: Mapping[str, torch.Tensor] | None = None) -> Any:
        assert weights is None, "weight stashing is refused for layer pipelines (pre-flight)"
        user = self.blocks[0]
        parent_path, _, attr = self.split.list_path.rpartition(".")
        parent = user.get_submodule(parent_path)
        layers = getattr(parent, attr)
        assert isinstance(layers, nn.ModuleList)
        part = nn.ModuleList(list(layers)[self.start : self.stop])
        handles = []
        if not self.first:

            def inject(module: nn.Module, args: Any, kwargs: Any) -> Any:
                if args:
                    return (x, *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": x}

            handles.append(part[0].register_forward_pre_hook(inject, with_kwargs=True))
        if not self.last:

            def leave(module: nn.Module, args: Any, output: Any) -> None:
                raise _StageExit(_hidden(output))

            handles.append(part[len(part) - 1].register_forward_hook(leave))
        setattr(parent, attr, part)
        inputs = self._context
        try:
            if isinstance(inputs, Mapping):
                return user(**inputs)
            return user(inputs)
        except _StageExit as done:
            return done.hidden
        finally:
            setattr(parent, attr, layers)
            for h in handles:
                h.remove()


def build_layer_stages(
    model: BlockModel, split: LayerSplit, ranges: list[tuple[int, int]], stages: Sequence[int]
) -> dict[int, LayerStage]:
    """One rank's stages over its one model ([Note: several layer stages per rank])."""
    return {s: LayerStage(model, split, ranges, s, owned=stages) for s in stages}


def cross_rank_ties(
    holders: list[tuple[nn.Parameter, set[int]]], rank_of: Callable[[int], int]
) -> list[tuple[nn.Parameter, tuple[int, ...]]]:
    """The tied parameters (`models.split.tied_stages`) held on more than one pipeline rank,
    with those ranks in order; a tie within one rank is summed by autograd ([Note: several
    layer stages per rank])."""
    out = []
    for param, stages in holders:
        ranks = tuple(sorted({rank_of(s) for s in stages}))
        if len(ranks) > 1:
            out.append((param, ranks))
    return out

"""A user's one-module model as the runtime cuts it: its layer pipeline (one `LayerStage` per
repeated layer, `layer_view`) and its ZeRO units (`fsdp_units`).

[Note: layer view] A transformers model is one block to the trainer ([Note: block view] in
`models.blocks`), so `measure.stats` counts it whole, which prices every layout but a pipeline.
A pipeline over its layers ([Note: layer pipeline] in `models.split`) runs `LayerStage`s: stage
``s`` runs the model's own forward with the layer list cut to its slice, the part before the
layers (embeddings, masks) on every stage (only the first trains it), the part after them
(final norm, head) on the last, a tied tensor (GPT-2's ``wte`` / ``lm_head``) owned by both
ends. The layer view is that runtime class itself at one layer per stage: each stage is built
on its own copy of the model (a stage demotes what it does not own; on meta, so a copy costs
nothing, except for a model `measure.stats` must count on the CPU, where the copies are capped
at 1 GiB) and counted by
`measure.stats.stats_of` as one block, so a stage of any partition is priced as the sum of its
layers' blocks, what the pre part costs included, and the first and the last stage each hold
the tie (two stages on one rank hold it once: `BlockStats.tied`). Tensor parallel inside the
stages splits each stage by the whole model's plan, only what the stage owns
(`measure.tp_stats.layer_styles`), so each layer block carries its own shards and modules. Not
offered: models with BatchNorm (a layer pipeline with more than one micro-batch cannot match one
process: models/checks.py), and, in the search, PipeDream (pre-flight refuses weight stashing
for layer pipelines).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from polytrain.config.job import JobConfig
from polytrain.data.datasets import DataSpec
from polytrain.models.base import BlockModel, Inputs
from polytrain.models.checks import has_batchnorm
from polytrain.models.registry import build_model
from polytrain.models.split import trace_sides
from polytrain.pipeline.layer_stage import LayerStage

__all__ = ["fsdp_units", "layer_view"]

# A model that cannot be counted on meta has its layer view built on the real device, one copy
# of the model per layer: past this many bytes of copies it gets none (no pipeline offered).
_REAL_COPIES_BYTES = 2**30


class _StageBlock(nn.Module):
    """One `LayerStage` as a block: the batch's model inputs are its context on every call
    (the first stage runs from them and ignores its argument)."""

    def __init__(self, stage: LayerStage, inputs: Inputs) -> None:
        super().__init__()
        self.stage = stage
        self.inputs = inputs

    def forward(self, hidden: torch.Tensor) -> Any:
        self.stage.set_context(self.inputs)
        return self.stage(hidden)


def layer_view(
    job: JobConfig, spec: DataSpec, model: BlockModel, inputs: Inputs
) -> BlockModel | None:
    """``job``'s model (built as ``model``, whose device the view takes) as one block per
    repeated layer, each running with ``inputs`` as its context ([Note: layer view]); None for
    a model the trainer does not pipeline over layers (the built-ins, an ``nn.Sequential``, a
    model without repeated layers or with BatchNorm). ``model`` is only traced, not changed."""
    if len(model.blocks) != 1 or len(model.layers) < 2 or has_batchnorm(model):
        return None
    device = next(model.parameters()).device
    if device.type != "meta" and len(model.layers) * _bytes(model) > _REAL_COPIES_BYTES:
        return None  # a model counted on a real device ([Note: data-dependent forwards])

    def forward() -> Any:
        with torch.no_grad():
            return model(inputs)  # BlockModel.forward passes named inputs as keywords

    split = trace_sides(model.blocks[0], model.layers[0].rpartition(".")[0], forward)
    ranges = [(i, i + 1) for i in range(len(model.layers))]
    stages: list[nn.Module] = []
    for index in range(len(ranges)):
        with torch.device(device):  # each stage demotes what it does not own: a model of its own
            copy = build_model(job.model, spec, job.train.seed)
        stages.append(_StageBlock(LayerStage(copy, split, ranges, index), inputs))
    return BlockModel(stages, model.loss_fn)


def _bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def fsdp_units(model: BlockModel) -> tuple[tuple[float, int], ...]:
    """[Note: FSDP units of a user's model] ZeRO shards a user's one-module model one repeated
    layer at a time and the rest (embeddings, final norm, head; a tie once) as the root unit
    (`parallel.zero`, [Note: block view] in models.blocks), where a built-in's units are its
    blocks. The cost model prices a unit's gather and reduce-scatter and its hooks, and ZeRO-3
    holds the largest unit gathered twice (current and prefetched), so a one-block model
    priced as one unit had one collective of everything and the whole model gathered.
    (parameter bytes, tensors) per unit, the root first; () for a model whose blocks are its
    units."""
    if len(model.blocks) != 1 or not model.layers:
        return ()
    layers = [(float(_bytes(unit)), len(list(unit.parameters()))) for unit in model.units()]
    whole = float(_bytes(model))
    tensors = len(list(model.parameters()))
    root = (whole - sum(b for b, _ in layers), tensors - sum(t for _, t in layers))
    return (root, *layers)

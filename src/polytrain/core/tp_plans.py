"""Tensor-parallel plans as data: a table of (module path pattern, style) rows (STYLE 3).

A plan is an ordered list of `PlanEntry`. Each pattern is an ``fnmatch`` pattern over the
model's module paths (``blocks.*.attn.q``; ``*`` also crosses dots); a module takes the style of
the first row that matches it, and modules no row matches stay replicated. The styles are
Megatron-LM's (Shoeybi et al. 2019) building blocks:

====================  ============  ==============================================================
style                 module        what each of the ``tp`` ranks holds and computes
====================  ============  ==============================================================
``colwise``           Linear        ``out/tp`` outputs of the weight; input replicated, output
                                    sharded on its last dim (feeds a ``rowwise`` layer)
``colwise_gather``    Linear        as ``colwise``, then the output is all-gathered (replicated):
                                    the last layer of a model, whose output goes to the loss
``rowwise``           Linear        ``in/tp`` inputs of the weight; input sharded on its last
                                    dim, partial outputs all-reduced (replicated)
``rowwise_split``     Linear        as ``rowwise``, but the input arrives replicated and each
                                    rank takes its slice (a head after replicated layers)
``qkv``               Conv1D        a fused [q | k | v] projection, each chunk column-split so
                                    a rank holds whole heads of q, k and v (GPT-2's ``c_attn``;
                                    [Note: fused projections under tp] in core.tp_styles)
``vocab``             nn.Embedding  rows ``num_embeddings/tp`` of the table (vocabulary parallel);
                                    ids replicated, looked-up rows all-reduced
====================  ============  ==============================================================

"Linear" is ``nn.Linear`` or transformers' ``Conv1D`` (a transposed linear, weight (in, out)).

The plan text form, used in ``parallel.tp_plan``, is one ``"pattern=style"`` string per row.
This module imports no torch: the matching and the divisibility rules are plain functions of
module paths and shapes, checked before launch (trainer/preflight.py) and again on each rank.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from polytrain.errors import ConfigError, MeshError

__all__ = [
    "STYLES",
    "TRANSFORMERS_PLANS",
    "FamilyRow",
    "ModuleInfo",
    "PlanEntry",
    "Style",
    "check_plan",
    "check_ties",
    "gpt_plan",
    "match_plan",
    "mlp_plan",
    "parse_plan",
]

Style = Literal["colwise", "colwise_gather", "rowwise", "rowwise_split", "qkv", "vocab"]
STYLES: tuple[str, ...] = get_args(Style)


@dataclass(frozen=True)
class PlanEntry:
    """One row of a plan: modules whose path matches ``pattern`` are split in ``style``."""

    pattern: str
    style: Style

    def __str__(self) -> str:
        return f"{self.pattern}={self.style}"


@dataclass(frozen=True)
class ModuleInfo:
    """What the plan checks need to know about one module (no torch objects)."""

    kind: Literal["linear", "conv1d", "embedding", "other"]
    in_dim: int = 0  # in_features (a Conv1D's nx), or embedding_dim
    out_dim: int = 0  # out_features (a Conv1D's nf), or num_embeddings


def parse_plan(rows: Sequence[str], field: str = "parallel.tp_plan") -> list[PlanEntry]:
    """``["blocks.*.attn.q=colwise", ...]`` -> plan entries; a malformed row is a ConfigError
    naming ``field``."""
    plan: list[PlanEntry] = []
    for i, row in enumerate(rows):
        pattern, sep, style = (part.strip() for part in row.rpartition("="))
        if not sep or not pattern:
            raise ConfigError(
                f"{field}[{i}] = {row!r}: expected 'pattern=style', e.g. 'blocks.*.mlp.fc=colwise'"
            )
        if style not in STYLES:
            raise ConfigError(
                f"{field}[{i}] = {row!r}: unknown style {style!r}; valid styles are "
                f"{', '.join(STYLES)}"
            )
        plan.append(PlanEntry(pattern, style))  # type: ignore[arg-type]  # checked just above
    return plan


def match_plan(
    plan: Sequence[PlanEntry],
    names: Sequence[str],
    suggest: Sequence[str] = (),
    what: str = "tensor-parallel plan",
) -> dict[str, Style]:
    """Module path -> style, first matching row wins. A row that matches nothing is an error
    naming the pattern and a few module paths (from ``suggest``, else ``names``) it could mean."""
    out: dict[str, Style] = {}
    for entry in plan:
        hits = [n for n in names if fnmatch.fnmatchcase(n, entry.pattern)]
        if not hits:
            pool = [n for n in (suggest or names) if n]
            shown = pool[:6]
            raise ConfigError(
                f"{what} row {str(entry)!r}: pattern {entry.pattern!r} matches no "
                f"module; splittable module paths look like {', '.join(shown)}"
                + (f" ... ({len(pool)} in all)" if len(pool) > len(shown) else "")
            )
        for name in hits:
            out.setdefault(name, entry.style)
    return out


_KINDS: dict[str, tuple[str, ...]] = {
    "vocab": ("embedding",),
    "qkv": ("conv1d",),
}
_WHAT = {"embedding": "nn.Embedding", "conv1d": "transformers Conv1D", "linear": "nn.Linear"}


def check_plan(assignment: Mapping[str, Style], modules: Mapping[str, ModuleInfo], tp: int) -> None:
    """Each matched module has the kind its style needs and a split dim divisible by ``tp``."""
    for name, style in assignment.items():
        info = modules[name]
        need = _KINDS.get(style, ("linear", "conv1d"))
        if info.kind not in need:
            what = " or ".join(_WHAT[k] for k in need)
            raise ConfigError(
                f"tensor-parallel plan: module {name!r} is not an {what}, which style "
                f"{style!r} needs; point the pattern at {what} modules only"
            )
        if style in ("rowwise", "rowwise_split"):
            dim, label = info.in_dim, "in_features"
        elif style == "vocab":
            dim, label = info.out_dim, "num_embeddings (vocabulary)"
        elif style == "qkv":
            dim, label = info.out_dim // 3, "the width of each of q, k, v"
            if info.out_dim % 3:
                raise ConfigError(
                    f"tensor-parallel plan: {name!r} ({style}) has {info.out_dim} outputs, not "
                    "three equal chunks q, k, v; use colwise for it"
                )
        else:
            dim, label = info.out_dim, "out_features"
        if dim % tp:
            raise MeshError(
                f"parallel.tp = {tp} does not divide {label} = {dim} of {name!r} ({style}): "
                f"choose a tp that divides {dim}, or leave {name!r} out of the plan"
            )


def _weight_split(info: ModuleInfo, style: Style | None) -> str:
    """How a style cuts the module's weight tensor itself (equal for tied modules)."""
    if style is None:
        return "whole"
    if style == "qkv":
        return "chunks of dim 1"
    rows = style in ("colwise", "colwise_gather", "vocab")  # output rows of (out, in) / (V, E)
    if info.kind == "conv1d":  # weight (in, out): the output dim is dim 1
        rows = not rows
    return "dim 0" if rows else "dim 1"


def check_ties(
    assignment: Mapping[str, Style],
    modules: Mapping[str, ModuleInfo],
    ties: Sequence[Sequence[str]],
) -> None:
    """Modules that share one weight (GPT-2's ``wte`` and ``lm_head``) must split it alike, so
    one distributed tensor serves both ([Note: tied weights under tp] in core.tp_styles)."""
    for group in ties:
        splits = {m: _weight_split(modules[m], assignment.get(m)) for m in group}
        if len(set(splits.values())) > 1:
            shown = ", ".join(
                f"{m} ({assignment.get(m, 'replicated')}: {s})" for m, s in splits.items()
            )
            raise ConfigError(
                f"tensor-parallel plan splits a tied weight two ways: {shown}; give these "
                "modules styles that cut the shared tensor alike (e.g. vocab and colwise_gather) "
                "or leave all of them replicated"
            )


def gpt_plan(vocab_size: int, tp: int) -> list[PlanEntry]:
    """Megatron's transformer split for `models.gpt`.

    Attention: q, k, v column-parallel (each rank holds ``n_head/tp`` whole heads; the attention
    infers its local head count from q's width), the output projection row-parallel. MLP: fc
    column-parallel, proj row-parallel. One all-reduce per sub-layer forward and one backward.
    When ``tp`` divides the vocabulary, the token embedding is vocabulary-parallel and the
    output layer column-parallel with its logits all-gathered before the (unchanged) loss;
    otherwise both stay replicated. LayerNorms and the position table stay replicated.
    """
    plan = [
        PlanEntry("blocks.*.attn.q", "colwise"),
        PlanEntry("blocks.*.attn.k", "colwise"),
        PlanEntry("blocks.*.attn.v", "colwise"),
        PlanEntry("blocks.*.attn.proj", "rowwise"),
        PlanEntry("blocks.*.mlp.fc", "colwise"),
        PlanEntry("blocks.*.mlp.proj", "rowwise"),
    ]
    if vocab_size % tp == 0:
        plan += [PlanEntry("blocks.0.tok", "vocab"), PlanEntry("blocks.*.out", "colwise_gather")]
    return plan


def mlp_plan(
    linear_paths: Sequence[str], out_features: Mapping[str, int], tp: int
) -> list[PlanEntry]:
    """`models.mlp`: hidden layers alternate column- and row-parallel (pairs of Megatron's MLP).

    ``linear_paths`` are the model's Linear layers in order, the output layer last. After an odd
    number of hidden layers the activation is sharded, so the output layer is row-parallel;
    after an even number it is replicated, so the output layer is column-parallel with its
    outputs gathered when ``tp`` divides its width, and replicated otherwise. The token
    embedding (16 wide) stays replicated.
    """
    *hidden, output = linear_paths
    plan = [PlanEntry(p, "colwise" if i % 2 == 0 else "rowwise") for i, p in enumerate(hidden)]
    if len(hidden) % 2 == 1:
        plan.append(PlanEntry(output, "rowwise"))
    elif out_features[output] % tp == 0:
        plan.append(PlanEntry(output, "colwise_gather"))
    return plan


@dataclass(frozen=True)
class FamilyRow:
    """A plan row for a transformers model family. ``pattern`` is relative to the base model
    (``config.base_model_prefix``: ``transformer``, ``bert``...) or, with ``on_model``, to the
    whole model (its heads); ``vocab`` rows apply only when ``tp`` divides the vocabulary and
    the module exists (a base model has no ``lm_head``)."""

    pattern: str
    style: Style
    on_model: bool = False
    vocab: bool = False


# Megatron's split for transformers models that publish no ``base_model_tp_plan``, keyed by
# ``config.model_type``: attention q, k, v column-parallel and its output projection
# row-parallel, the MLP's first layer column- and second row-parallel (one all-reduce per
# sub-layer forward and one backward). GPT-2's fused ``c_attn`` is split per chunk (``qkv``) and
# its tied ``wte``/``lm_head`` share one vocabulary-split tensor. ResNet's convolutions stay
# replicated (torch 2.13's DTensor shards a convolution only over the batch, not its channels);
# its classifier is row-split (its 3 to 1000 classes need not divide tp). docs/models.md.
TRANSFORMERS_PLANS: dict[str, tuple[FamilyRow, ...]] = {
    "gpt2": (
        FamilyRow("h.*.attn.c_attn", "qkv"),
        FamilyRow("h.*.attn.c_proj", "rowwise"),
        FamilyRow("h.*.mlp.c_fc", "colwise"),
        FamilyRow("h.*.mlp.c_proj", "rowwise"),
        FamilyRow("wte", "vocab", vocab=True),
        FamilyRow("lm_head", "colwise_gather", on_model=True, vocab=True),
    ),
    "bert": (
        FamilyRow("encoder.layer.*.attention.self.query", "colwise"),
        FamilyRow("encoder.layer.*.attention.self.key", "colwise"),
        FamilyRow("encoder.layer.*.attention.self.value", "colwise"),
        FamilyRow("encoder.layer.*.attention.output.dense", "rowwise"),
        FamilyRow("encoder.layer.*.intermediate.dense", "colwise"),
        FamilyRow("encoder.layer.*.output.dense", "rowwise"),
        FamilyRow("embeddings.word_embeddings", "vocab", vocab=True),
    ),
    "vit": (
        FamilyRow("layers.*.attention.q_proj", "colwise"),
        FamilyRow("layers.*.attention.k_proj", "colwise"),
        FamilyRow("layers.*.attention.v_proj", "colwise"),
        FamilyRow("layers.*.attention.o_proj", "rowwise"),
        FamilyRow("layers.*.mlp.fc1", "colwise"),
        FamilyRow("layers.*.mlp.fc2", "rowwise"),
    ),
    "resnet": (FamilyRow("classifier.1", "rowwise_split", on_model=True),),
}

"""Tensor-parallel plans as data: a table of (module path pattern, style) rows (STYLE 3).

A plan is an ordered list of `PlanEntry`. Each pattern is an ``fnmatch`` pattern over the
model's module paths (``blocks.*.attn.q``; ``*`` also crosses dots); a module takes the style of
the first row that matches it, and modules no row matches stay replicated. The styles are
Megatron-LM's (Shoeybi et al. 2019) building blocks:

====================  ============  ==============================================================
style                 module        what each of the ``tp`` ranks holds and computes
====================  ============  ==============================================================
``colwise``           nn.Linear     rows ``out/tp`` of the weight; input replicated, output
                                    sharded on its last dim (feeds a ``rowwise`` layer)
``colwise_gather``    nn.Linear     as ``colwise``, then the output is all-gathered (replicated):
                                    the last layer of a model, whose output goes to the loss
``rowwise``           nn.Linear     columns ``in/tp`` of the weight; input sharded on its last
                                    dim, partial outputs all-reduced (replicated)
``vocab``             nn.Embedding  rows ``num_embeddings/tp`` of the table (vocabulary parallel);
                                    ids replicated, looked-up rows all-reduced
====================  ============  ==============================================================

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
    "ModuleInfo",
    "PlanEntry",
    "Style",
    "check_plan",
    "gpt_plan",
    "match_plan",
    "mlp_plan",
    "parse_plan",
]

Style = Literal["colwise", "colwise_gather", "rowwise", "vocab"]
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

    kind: Literal["linear", "embedding", "other"]
    in_dim: int = 0  # in_features, or embedding_dim
    out_dim: int = 0  # out_features, or num_embeddings


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


def check_plan(assignment: Mapping[str, Style], modules: Mapping[str, ModuleInfo], tp: int) -> None:
    """Each matched module has the kind its style needs and a split dim divisible by ``tp``."""
    for name, style in assignment.items():
        info = modules[name]
        need = "embedding" if style == "vocab" else "linear"
        if info.kind != need:
            what = "nn.Embedding" if need == "embedding" else "nn.Linear"
            raise ConfigError(
                f"tensor-parallel plan: module {name!r} is not an {what}, which style "
                f"{style!r} needs; point the pattern at {what} modules only"
            )
        if style == "rowwise":
            dim, label = info.in_dim, "in_features"
        elif style == "vocab":
            dim, label = info.out_dim, "num_embeddings (vocabulary)"
        else:
            dim, label = info.out_dim, "out_features"
        if dim % tp:
            raise MeshError(
                f"parallel.tp = {tp} does not divide {label} = {dim} of {name!r} ({style}): "
                f"choose a tp that divides {dim}, or leave {name!r} out of the plan"
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

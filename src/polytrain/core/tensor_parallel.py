"""Tensor (model) parallelism through DTensor's ``parallelize_module`` (Megatron-LM; Shoeybi et
al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism",
2019).

The split is a plan (`core.tp_plans`): rows of (module path pattern, style). This module
turns the plan into torch's ``ColwiseParallel`` / ``RowwiseParallel`` styles on the ``tp``
sub-mesh. Megatron's ``f`` (identity forward, all-reduce backward) and ``g`` (all-reduce
forward, identity backward) are DTensor redistributions inserted by those styles at the input of
a column-parallel layer and the output of a row-parallel one.

[Note: replicated parameters under tp] Parameters no row matches (LayerNorms, the position
table, any replicated embedding) stay plain tensors. Their inputs are replicated (every
row-parallel output is all-reduced), and the gradient that reaches them is too (the ``f``
redistribution all-reduces it), so every tp rank computes the same gradient for them and the
same update: no extra communication is needed to keep them equal. Gradient clipping must count
a sharded gradient's norm across tp ranks and a replicated one once; see
`parallel.grad_norm.grad_norm`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from polytrain._lazy_dist import is_dtensor, local_tensor
from polytrain.comm.collectives import all_reduce_sum_
from polytrain.comm.mesh import Mesh
from polytrain.config.job import JobConfig
from polytrain.core.tp_plans import (
    TRANSFORMERS_PLANS,
    ModuleInfo,
    PlanEntry,
    Style,
    check_plan,
    check_ties,
    gpt_plan,
    match_plan,
    mlp_plan,
    parse_plan,
)
from polytrain.core.tp_styles import (
    conv1d_colwise,
    conv1d_rowwise,
    fix_split_width,
    is_conv1d,
    retie,
    tied_uses,
)
from polytrain.errors import MeshError

if TYPE_CHECKING:  # [Note: lazy torch.distributed] in _lazy_dist.py
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = [
    "apply_tensor_parallel",
    "apply_tensor_parallel_to_stage",
    "check_tp_plan",
    "full_tensors",
    "grad_square_sum",
    "like_param",
    "local_tensor",
    "module_infos",
    "parallelize",
    "parallelize_layer_stage",
    "resolve_tp_plan",
    "style_of",
]


def module_infos(model: nn.Module) -> dict[str, ModuleInfo]:
    """Path -> kind and dims of every module (works on the meta device)."""
    out: dict[str, ModuleInfo] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            out[name] = ModuleInfo("linear", module.in_features, module.out_features)
        elif is_conv1d(module):
            nx, nf = module.weight.shape
            out[name] = ModuleInfo("conv1d", int(nx), int(nf))
        elif isinstance(module, nn.Embedding):
            out[name] = ModuleInfo("embedding", module.embedding_dim, module.num_embeddings)
        else:
            out[name] = ModuleInfo("other")
    return out


def _builtin_plan(model_name: str, model: nn.Module, tp: int) -> list[PlanEntry]:
    infos = module_infos(model)
    if model_name == "gpt":
        vocab = next(i.out_dim for n, i in infos.items() if n.endswith(".tok"))
        for name, module in model.named_modules():
            head_dim = getattr(module, "head_dim", None)
            q = getattr(module, "q", None)
            if isinstance(head_dim, int) and isinstance(q, nn.Linear):
                n_head = q.out_features // head_dim
                if n_head % tp:
                    raise MeshError(
                        f"parallel.tp = {tp} does not divide the {n_head} attention heads of "
                        f"{name!r}: choose a tp that divides model.n_head = {n_head}"
                    )
        return gpt_plan(vocab, tp)
    if model_name in ("mlp", "cnn", "resnet"):  # their Linear layers in order; convs replicated
        linears = [n for n, i in infos.items() if i.kind == "linear"]
        return mlp_plan(linears, {n: infos[n].out_dim for n in linears}, tp)
    own = _own_plan(model) or _family_plan(model, infos, tp)
    if own:
        return own
    raise MeshError(
        f"parallel.tp = {tp} for model {model_name!r}, which has no built-in tensor-parallel "
        "plan: give one as parallel.tp_plan = ['path.pattern=colwise', ...]"
    )


def _user_module(model: nn.Module) -> nn.Module:
    blocks = getattr(model, "blocks", None)
    return blocks[0] if isinstance(blocks, nn.Sequential) else model


def _base_prefix(user: nn.Module) -> str:
    """``blocks.0.`` plus the transformers base model's attribute (``transformer.``...)."""
    base = getattr(user, "base_model_prefix", "")
    return "blocks.0." + (f"{base}." if base and hasattr(user, base) else "")


def _family_plan(model: nn.Module, infos: Mapping[str, ModuleInfo], tp: int) -> list[PlanEntry]:
    """Our plan for a transformers model family without its own (`tp_plans.TRANSFORMERS_PLANS`)."""
    user = _user_module(model)
    config = getattr(user, "config", None)
    rows = TRANSFORMERS_PLANS.get(str(getattr(config, "model_type", "")), ())
    if not rows:
        return []
    heads = getattr(config, "num_attention_heads", None)
    if isinstance(heads, int) and heads % tp:
        raise MeshError(
            f"parallel.tp = {tp} does not divide the {heads} attention heads of the model "
            f"({type(user).__name__}): choose a tp that divides {heads}"
        )
    vocab = getattr(config, "vocab_size", None)
    vocab_splits = isinstance(vocab, int) and vocab % tp == 0
    plan = []
    for row in rows:
        pattern = ("blocks.0." if row.on_model else _base_prefix(user)) + row.pattern
        if row.vocab and (not vocab_splits or pattern not in infos):
            continue
        plan.append(PlanEntry(pattern, row.style))
    return plan


# transformers' plan styles that are ours (others, e.g. packed or sequence-parallel, are not)
_HF_STYLES: dict[str, Style] = {"colwise": "colwise", "rowwise": "rowwise"}


def _own_plan(model: nn.Module) -> list[PlanEntry]:
    """A transformers model's own ``base_model_tp_plan``, as plan rows over our module paths.

    transformers publishes the plan on the config, relative to the base model
    (``model.layers.*.self_attn.q_proj`` is ``layers.*.self_attn.q_proj`` under
    ``base_model_prefix = "model"``). A user model is ``blocks.0`` of the `BlockModel`.
    """
    user = _user_module(model)
    config = getattr(user, "config", None)
    plan = getattr(config, "base_model_tp_plan", None) or {}
    if not plan:
        return []
    prefix = _base_prefix(user)
    rows = []
    for pattern, style in plan.items():
        if style not in _HF_STYLES:
            raise MeshError(
                f"the model's own tensor-parallel plan has {pattern!r} = {style!r}, a style "
                f"polytrain does not offer ({', '.join(_HF_STYLES)}): give "
                "parallel.tp_plan rows instead"
            )
        rows.append(PlanEntry(prefix + pattern, _HF_STYLES[style]))
    return rows


def check_tp_plan(job: JobConfig, model: nn.Module) -> None:
    """Pre-flight, for every family that applies tensor parallelism (SPMD, pipeline stages):
    heads, widths and vocabulary divisible by ``tp``; every plan row matches a module."""
    if job.parallel.tp > 1:
        resolve_tp_plan(job.model.name, model, job.parallel.tp, job.parallel.tp_plan)


def resolve_tp_plan(
    model_name: str, model: nn.Module, tp: int, rows: Sequence[str]
) -> dict[str, Style]:
    """Module path -> style for this model and degree, every rule checked (no collectives)."""
    plan = parse_plan(rows) if rows else _builtin_plan(model_name, model, tp)
    infos = module_infos(model)
    splittable = [n for n, i in infos.items() if i.kind != "other"]
    assignment = match_plan(plan, list(infos), splittable)
    check_plan(assignment, infos, tp)
    check_ties(assignment, infos, [[path for path, _ in g] for g in tied_uses(model)])
    return assignment


def style_of(style: Style, module: nn.Module) -> ParallelStyle:
    """torch's parallel style for one of our plan styles, on ``module`` (Conv1D gets its own)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if is_conv1d(module):
        if style == "qkv":
            return conv1d_colwise(chunks=3)
        if style == "colwise":
            return conv1d_colwise()
        if style == "colwise_gather":
            return conv1d_colwise(output_layouts=Replicate())
        if style == "rowwise":
            return conv1d_rowwise()
        return conv1d_rowwise(input_layouts=Replicate())  # rowwise_split
    if style == "colwise":
        return ColwiseParallel()
    if style == "colwise_gather":
        return ColwiseParallel(output_layouts=Replicate())
    if style == "rowwise":
        return RowwiseParallel()
    # vocab (ids replicated, rows all-reduced) and rowwise_split (each rank slices its inputs)
    return RowwiseParallel(input_layouts=Replicate())


def parallelize(root: nn.Module, tp_mesh: DeviceMesh, assignment: Mapping[str, Style]) -> None:
    """Apply the styles, then the fix-ups a style needs outside its module: fused projections'
    split width, and tied weights put back together (core.tp_styles)."""
    from torch.distributed.tensor.parallel import parallelize_module

    ties = tied_uses(root)
    styles = {name: style_of(s, root.get_submodule(name)) for name, s in assignment.items()}
    if styles:
        parallelize_module(root, tp_mesh, styles)
    fused = [name for name, s in assignment.items() if s == "qkv"]
    fix_split_width(root, fused, 3, tp_mesh.size())
    retie(root, ties)


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, model_name: str, rows: Sequence[str]
) -> nn.Module:
    """Split ``model`` in place over the 1-D ``tp_mesh`` by the job's (or built-in) plan."""
    assignment = resolve_tp_plan(model_name, model, tp_mesh.size(), rows)
    parallelize(model, tp_mesh, assignment)
    return model


# -- tensor parallel inside a pipeline stage (pp x dp x tp) ------------------------------------


def apply_tensor_parallel_to_stage(
    stage: nn.Module, model: nn.Module, tp_mesh: DeviceMesh, model_name: str, rows: Sequence[str]
) -> nn.Module:
    """Split one pipeline stage by the plan of the whole ``model``.

    The plan is resolved (and checked) against the full model, so a row naming a module of
    another stage is not an error; the stage's module paths are the full model's
    (``blocks.<i>...``), so the assignment applies to it as it is.
    """
    assignment = resolve_tp_plan(model_name, model, tp_mesh.size(), rows)
    names = {name for name, _ in stage.named_modules()}
    parallelize(stage, tp_mesh, {name: s for name, s in assignment.items() if name in names})
    return stage


def parallelize_layer_stage(
    stage: nn.Module, tp_mesh: DeviceMesh, assignment: Mapping[str, Style]
) -> None:
    """Split a layer-pipeline stage by the whole model's ``assignment`` (resolved before the
    stage demoted what it does not own): only modules whose weights the stage owns are split;
    the rest run only in the stage's discarded part ([Note: layer pipeline]), replicated."""
    owned = {
        name
        for name, module in stage.named_modules()
        if any(True for _ in module.parameters(recurse=False))
    }
    parallelize(stage, tp_mesh, {name: s for name, s in assignment.items() if name in owned})


def like_param(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``grad`` laid out as ``param`` (no communication from Replicate to Shard).

    A vocabulary-parallel embedding's weight gradient comes back replicated (every rank holds
    the whole (V, E) gradient) when no other use of the weight adds a sharded one, as on the
    first stage of a pipeline whose head is on the last: tied shards must pair shard for shard.
    """
    if is_dtensor(grad) and is_dtensor(param):
        if tuple(grad.placements) != tuple(param.placements):
            return grad.redistribute(param.device_mesh, param.placements)
    return grad


def grad_square_sum(grads: Sequence[torch.Tensor], mesh: Mesh) -> torch.Tensor:
    """Sum of squares of ``grads`` over this rank's tensor-parallel group: a sharded gradient's
    squares are summed over its shards, a replicated one (equal on every tp rank) counted once.
    Multi-tensor norms on the gradients' device (nothing is read on the host)."""
    device = grads[0].device if grads else torch.device("cpu")
    sharded: list[torch.Tensor] = []
    replicated: list[torch.Tensor] = []
    for g in grads:
        is_sharded = is_dtensor(g) and not all(p.is_replicate() for p in g.placements)
        (sharded if is_sharded else replicated).append(local_tensor(g).detach())
    sharded_sq = _square_norm(sharded, device)
    if mesh.dims.tp > 1:
        all_reduce_sum_(sharded_sq, mesh.group("tp"))
    return sharded_sq + _square_norm(replicated, device)


def _square_norm(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The squared 2-norm of ``tensors`` together, in float32 on ``device``."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.nn.utils.get_total_norm(tensors).to(device, torch.float32).square()


def full_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Collective over each DTensor's mesh: every value whole (plain tensors pass through)."""
    return {k: v.full_tensor() if is_dtensor(v) else v for k, v in state.items()}

"""Tensor (model) parallelism through DTensor's ``parallelize_module`` (Megatron-LM; Shoeybi et
al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism",
2019).

The split is a plan (`parallel.tp_plans`): rows of (module path pattern, style). This module
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
`parallel.grad_norm.clip_grad_norm_`.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from polytrain.errors import MeshError
from polytrain.parallel.tp_plans import (
    ModuleInfo,
    PlanEntry,
    Style,
    check_plan,
    gpt_plan,
    match_plan,
    mlp_plan,
    parse_plan,
)

__all__ = ["apply_tensor_parallel", "module_infos", "resolve_tp_plan"]


def module_infos(model: nn.Module) -> dict[str, ModuleInfo]:
    """Path -> kind and dims of every module (works on the meta device)."""
    out: dict[str, ModuleInfo] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            out[name] = ModuleInfo("linear", module.in_features, module.out_features)
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
    if model_name == "mlp":
        linears = [n for n, i in infos.items() if i.kind == "linear"]
        return mlp_plan(linears, {n: infos[n].out_dim for n in linears}, tp)
    raise MeshError(
        f"parallel.tp = {tp} for model {model_name!r}, which has no built-in tensor-parallel "
        "plan: give one as parallel.tp_plan = ['path.pattern=colwise', ...]"
    )


def resolve_tp_plan(
    model_name: str, model: nn.Module, tp: int, rows: Sequence[str]
) -> dict[str, Style]:
    """Module path -> style for this model and degree, every rule checked (no collectives)."""
    plan = parse_plan(rows) if rows else _builtin_plan(model_name, model, tp)
    infos = module_infos(model)
    splittable = [n for n, i in infos.items() if i.kind != "other"]
    assignment = match_plan(plan, list(infos), splittable)
    check_plan(assignment, infos, tp)
    return assignment


def _style(style: Style) -> ParallelStyle:
    if style == "colwise":
        return ColwiseParallel()
    if style == "colwise_gather":
        return ColwiseParallel(output_layouts=Replicate())
    if style == "rowwise":
        return RowwiseParallel()
    return RowwiseParallel(input_layouts=Replicate())  # vocab: ids replicated, rows all-reduced


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, model_name: str, rows: Sequence[str]
) -> nn.Module:
    """Split ``model`` in place over the 1-D ``tp_mesh`` by the job's (or built-in) plan."""
    assignment = resolve_tp_plan(model_name, model, tp_mesh.size(), rows)
    parallelize_module(model, tp_mesh, {name: _style(s) for name, s in assignment.items()})
    return model

"""Hybrid parallelism: data parallel where compute dominates, model parallel where parameters do.

Krizhevsky, "One weird trick for parallelizing convolutional neural networks" (2014), and PAI's
hybrid parallelism: a convolutional network's convolutions hold few parameters and do most of
the FLOPs, its fully connected layers hold most of the parameters and do few FLOPs. So every
rank runs the convolutions on its own slice of the batch (data parallel: their small gradients
are all-reduced by DDP), and the wide Linear layers are split over the same ranks (tensor
parallel, `core.tp_plans` styles) and run on the whole batch: their large gradients are
never exchanged, only activations are.

``parallel.hybrid`` is a plan in the tensor-parallel row format (``"pattern=style"``) naming the
Linear layers that are split; every other module stays data parallel. ``["auto"]`` chooses the
layers (`auto_layers`). The split layers must follow the data-parallel part: from the first split
module on, the model runs on the whole batch.

[Note: hybrid activation redistribution] Before the first split module, each rank's rows are
all-gathered (``comm.autograd.all_gather_rows``): the split layers see the whole batch in rank
order, which is the global batch of the step (contract 1's slices). Everything after runs on the
whole batch, identical on every rank; the loss is taken over the whole batch's targets (each
rank fetches them from the layout-invariant sampler, no communication). In backward the
column-parallel input all-reduces its gradient (Megatron's ``f``), so each rank holds the whole
batch's activation gradient and keeps its own rows.

[Note: hybrid gradient scale] A rank's convolution gradient is then its rows' share of the
whole-batch loss gradient, and the true gradient is the *sum* over ranks; DDP averages. The
gathered rows' gradient is therefore multiplied by the group size in backward, so DDP's mean
is the sum. Modules after the boundary that are not split compute the same full gradient on
every rank, and DDP's mean leaves it unchanged.

Shapes: B global batch, N ranks (B/N rows each before the boundary), F features.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from polytrain.comm.autograd import all_gather_rows
from polytrain.comm.mesh import Mesh
from polytrain.core.tensor_parallel import module_infos, parallelize
from polytrain.core.tp_plans import (
    ModuleInfo,
    PlanEntry,
    Style,
    check_plan,
    match_plan,
    parse_plan,
)
from polytrain.errors import ConfigError

__all__ = ["apply_hybrid", "auto_layers", "hybrid_ignored", "resolve_hybrid_plan"]


def auto_layers(infos: dict[str, ModuleInfo], global_batch: int, ranks: int) -> list[str]:
    """PAI's rule, per Linear layer: split it when its weight (what data parallel all-reduces,
    ``in * out`` values) outweighs the activations hybrid moves for it (``B * (in + out)``
    values: its input gathered, its output reduced). A convolution's FLOPs per parameter are
    ``H * W`` times a Linear's, and its weights are small: convolutions stay data parallel.
    The chosen layers are kept only when they form the tail of the model's Linear layers
    (one boundary; [Note: hybrid activation redistribution]) and divide by ``ranks``."""
    linears = [n for n, i in infos.items() if i.kind == "linear"]
    chosen = [
        n
        for n in linears
        if infos[n].in_dim * infos[n].out_dim > global_batch * (infos[n].in_dim + infos[n].out_dim)
        and infos[n].out_dim % ranks == 0
        and infos[n].in_dim % ranks == 0
    ]
    if not chosen:
        return []
    return linears[linears.index(chosen[0]) : linears.index(chosen[-1]) + 1]


def resolve_hybrid_plan(
    model: nn.Module, rows: Sequence[str], ranks: int, global_batch: int
) -> dict[str, Style]:
    """Module path -> style of the split layers (no collectives); a `ConfigError` for a row
    that names no module, a style a module cannot take, or a width ``ranks`` does not divide."""
    infos = module_infos(model)
    if list(rows) == ["auto"]:
        layers = auto_layers(infos, global_batch, ranks)
        if not layers:
            raise ConfigError(
                "parallel.hybrid = ['auto'] found no Linear layer whose weights outweigh its "
                f"activations at a global batch of {global_batch} (and divisible by {ranks}): "
                "use plain data parallel (parallel.hybrid = []) or name the layers"
            )
        # Column- then row-parallel pairs (Megatron's MLP); an odd run ends column-parallel
        # with its output gathered, as the whole batch's loss needs it whole.
        plan = [PlanEntry(n, "colwise" if i % 2 == 0 else "rowwise") for i, n in enumerate(layers)]
        if len(layers) % 2:
            plan[-1] = PlanEntry(layers[-1], "colwise_gather")
    else:
        plan = parse_plan(rows, field="parallel.hybrid")
    splittable = [n for n, i in infos.items() if i.kind == "linear"]
    assignment = match_plan(plan, list(infos), splittable, what="hybrid plan")
    check_plan(assignment, infos, ranks)
    return assignment


def hybrid_ignored(model: nn.Module, assignment: dict[str, Style]) -> list[str]:
    """Parameter names of the split modules (DDP must leave them alone)."""
    return [
        f"{name}.{p}"
        for name in assignment
        for p, _ in model.get_submodule(name).named_parameters()
    ]


def apply_hybrid(model: nn.Module, mesh: Mesh, assignment: dict[str, Style]) -> None:
    """Split the planned modules over the ``dp`` ranks and gather the batch before the first
    ([Note: hybrid activation redistribution]); the caller wraps the rest in DDP."""
    first = next(name for name, _ in model.named_modules() if name in assignment)
    group, size = mesh.group("dp"), mesh.dims.dp

    def gather(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        # [Note: hybrid gradient scale]
        return (all_gather_rows(args[0], group, grad_scale=float(size)), *args[1:])

    # Registered before parallelize_module's own input hook, so it runs first.
    model.get_submodule(first).register_forward_pre_hook(gather)
    parallelize(model, mesh.sub("dp"), assignment)

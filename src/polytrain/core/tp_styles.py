"""Tensor-parallel styles for layers DTensor's own styles do not take: transformers' ``Conv1D``
(a transposed linear, GPT-2's ``c_attn``, ``c_proj``, ``c_fc``) and fused projections whose
output is several chunks side by side (GPT-2's ``c_attn`` = [q | k | v]).

[Note: fused projections under tp] A column-parallel split of GPT-2's fused ``c_attn`` weight
(in, 3E) into contiguous halves would give rank 0 all of q and half of k: no rank could run its
heads. Megatron stores its fused QKV interleaved per head for that reason. Here the weight keeps
the user's layout and its DTensor placement says how it is split: ``strided_shard(1, 3)`` cuts
each of the three chunks over the ranks, so rank ``r`` holds [q_r | k_r | v_r] (whole heads of
each) and ``full_tensor()``, state dicts, checkpoints and the export all see the original
(in, 3E) layout, unpermuted. DTensor's matmul and view propagate that placement, so the module's
own forward runs unchanged; its output, taken local, is (B, T, 3E/tp) = [q_r | k_r | v_r], and
the parent attention splits it by ``split_size``, which `fix_split_width` divides by ``tp``.

[Note: tied weights under tp] GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``. Both
styles that can touch it shard that (V, E) tensor on dim 0 (vocabulary-parallel embedding, and
the column-parallel head), but ``parallelize_module`` distributes each module's parameter on its
own, which would leave two independent copies. `retie` puts the first DTensor back in every
place the tensor was used, so both uses accumulate into one gradient, as in one process.

Shapes: B batch, T time, E embedding, V vocabulary; a Conv1D weight is (in, out).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from polytrain._torch_private import strided_shard
from polytrain.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor, Placement
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = [
    "conv1d_colwise",
    "conv1d_rowwise",
    "fix_split_width",
    "is_conv1d",
    "retie",
    "tied_uses",
]


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (or any layer like it): ``weight`` (nx, nf), ``x @ weight + b``."""
    weight = getattr(module, "weight", None)
    nx, nf = getattr(module, "nx", None), getattr(module, "nf", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(weight, nn.Parameter)
        and tuple(weight.shape) == (nx, nf)
    )


def _distribute_params(
    module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement]
) -> None:
    from torch.distributed.tensor import distribute_tensor

    for name, param in list(module.named_parameters(recurse=False)):
        dist = distribute_tensor(param, mesh, [placements[name]])
        module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


def _input(
    given: tuple[Placement, ...],
    desired: tuple[Placement, ...],
    module: nn.Module,
    inputs: tuple[Any, ...],
    mesh: DeviceMesh,
) -> DTensor:
    """The module's input as a DTensor laid out as the style needs (as torch's styles do)."""
    from torch.distributed.tensor import DTensor

    x = inputs[0]
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, given, run_check=False)
    return x.redistribute(placements=desired) if given != desired else x


def _output(
    layouts: tuple[Placement, ...], local: bool, module: nn.Module, y: DTensor, mesh: DeviceMesh
) -> Any:
    if tuple(y.placements) != tuple(layouts):
        y = y.redistribute(placements=layouts)
    return y.to_local() if local else y


def conv1d_colwise(chunks: int = 1, **kwargs: Any) -> ParallelStyle:
    """Column-parallel ``Conv1D``: weight (in, out) split on dim 1, bias on dim 0; the input is
    replicated, the output sharded on its last dim (gathered when ``output_layouts`` is
    Replicate). ``chunks > 1``: a fused projection, each chunk split ([Note: fused projections
    under tp]). ``kwargs`` are ``ColwiseParallel``'s."""
    return _conv1d_styles()[0](chunks, **kwargs)


def conv1d_rowwise(**kwargs: Any) -> ParallelStyle:
    """Row-parallel ``Conv1D``: weight (in, out) split on dim 0, bias replicated; the input is
    sharded on its last dim, the partial outputs all-reduced (Megatron's ``g``). ``kwargs`` are
    ``RowwiseParallel``'s."""
    return _conv1d_styles()[1](**kwargs)


@functools.cache
def _conv1d_styles() -> tuple[Callable[..., ParallelStyle], Callable[..., ParallelStyle]]:
    """The two style classes, defined on first use: they subclass DTensor's styles, whose
    package only tensor-parallel jobs import ([Note: lazy torch.distributed] in _lazy_dist.py).
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    class Conv1DColwise(ColwiseParallel):
        def __init__(self, chunks: int = 1, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.chunks = chunks

        def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
            if self.chunks > 1:
                placements = {
                    "weight": strided_shard(1, self.chunks),
                    "bias": strided_shard(0, self.chunks),
                }
            else:
                placements = {"weight": Shard(1), "bias": Shard(0)}
            _distribute_params(module, mesh, placements)

        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            inputs: Any = partial(_input, self.input_layouts, self.desired_input_layouts)
            # (returns the new input; torch types input_fn as returning None)
            outputs: Any = partial(_output, self.output_layouts, self.use_local_output)
            if self.chunks > 1:  # keep the chunked layout: redistributing to Shard(-1) reorders
                outputs = _local_output
            return distribute_module(module, device_mesh, self._partition, inputs, outputs)

    class Conv1DRowwise(RowwiseParallel):
        def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
            _distribute_params(module, mesh, {"weight": Shard(0), "bias": Replicate()})

        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            self.desired_input_layouts = (Shard(-1),)
            inputs: Any = partial(_input, self.input_layouts, self.desired_input_layouts)
            # (returns the new input; torch types input_fn as returning None)
            outputs = partial(_output, self.output_layouts, self.use_local_output)
            return distribute_module(module, device_mesh, self._partition, inputs, outputs)

    return Conv1DColwise, Conv1DRowwise


def _local_output(module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
    """The local [q_r | k_r | v_r] of a fused projection, as its placement already holds it."""
    return output.to_local()


def fix_split_width(model: nn.Module, fused_paths: Sequence[str], chunks: int, tp: int) -> None:
    """Divide the ``split_size`` of each fused projection's parent by ``tp`` (its local output is
    ``chunks`` pieces of ``split_size / tp``; [Note: fused projections under tp])."""
    for path in fused_paths:
        parent_path = path.rpartition(".")[0]
        parent = model.get_submodule(parent_path)
        width = getattr(parent, "split_size", None)
        nf = getattr(model.get_submodule(path), "nf", None)
        if not isinstance(width, int) or nf != chunks * width:
            raise ConfigError(
                f"tensor-parallel style 'qkv' on {path!r}: its parent {parent_path!r} must split "
                f"the fused output by an attribute split_size = out/{chunks} (GPT-2's attention "
                "does); use colwise for this layer or give the parent that attribute"
            )
        setattr(parent, "split_size", width // tp)  # noqa: B010  (Module.__setattr__ is typed for tensors)


def tied_uses(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module path, attribute) that hold one shared Parameter (GPT-2's wte/lm_head)."""
    uses: dict[int, list[tuple[str, str]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False):
            uses.setdefault(id(param), []).append((path, name))
    return [group for group in uses.values() if len(group) > 1]


def retie(model: nn.Module, groups: Sequence[Sequence[tuple[str, str]]]) -> None:
    """Make every use in each group hold the first use's (now distributed) Parameter again
    ([Note: tied weights under tp]); pre-flight checked that their placements agree."""
    for (path, name), *rest in groups:
        shared = getattr(model.get_submodule(path), name)
        for other_path, other_name in rest:
            other = getattr(model.get_submodule(other_path), other_name)
            placements = getattr(other, "placements", None)
            assert placements == getattr(shared, "placements", None), (path, other_path)
            model.get_submodule(other_path).register_parameter(other_name, shared)

"""What the runtime's tensor-parallel plan does to each block, for `measure.stats` (torch-facing).

Which parameter bytes a plan splits ([Note: tensor-parallel shards]) and which modules it
parallelizes, with the activations their collectives move ([Note: tensor-parallel modules] in
planner/cost/tp.py). The plan is the runtime's own (`core.tensor_parallel.resolve_tp_plan`),
resolved at tp = 1 so that every conditional row is in; a row that applies only when tp
divides a dimension (the vocabulary rows) carries that dimension as its divisor.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from polytrain._torch_private import TorchDispatchMode, storage_key
from polytrain.core.tensor_parallel import module_infos, resolve_tp_plan
from polytrain.core.tp_plans import ModuleInfo
from polytrain.errors import ConfigError, MeshError
from polytrain.models.base import BlockModel
from polytrain.planner.types import TPModule, splits_inputs

__all__ = [
    "SplitActivations",
    "TPModules",
    "layer_styles",
    "layer_ties",
    "plan_styles",
    "tensors_in",
    "tp_shards",
]


def plan_styles(model: BlockModel, model_name: str, plan_rows: list[str]) -> dict[str, str] | None:
    """The runtime's tensor-parallel plan resolved at tp = 1 (every conditional row in), or
    None for a model without one."""
    try:
        return dict(resolve_tp_plan(model_name, model, 1, plan_rows))
    except (ConfigError, MeshError):
        return None


def _divisor(style: str, info: ModuleInfo, pname: str = "weight") -> int:
    """The dimension ``style`` splits parameter ``pname`` of a module by (1: kept whole)."""
    if splits_inputs(style):
        return info.in_dim if pname == "weight" else 1
    if style == "qkv":
        return info.out_dim // 3
    return info.out_dim  # colwise, colwise_gather, vocab: the output rows


def tp_shards(
    model: BlockModel, styles: dict[str, str] | None
) -> list[tuple[tuple[float, int], ...]]:
    """Per block, the (bytes, divisor) pairs of [Note: tensor-parallel shards]: what the
    runtime's tensor-parallel plan splits, and by which dimension. Column-parallel layers split
    weight and bias by their outputs, row-parallel ones the weight by its inputs and leave the
    bias whole (torch's ``RowwiseParallel``), ``qkv`` by the width of each chunk, ``vocab`` by
    the vocabulary; modules no row matches stay whole (divisor 1). A model without a plan
    (``styles`` None, from `plan_styles`) gets ``()`` per block (everything split: the old
    estimate)."""
    if styles is None:
        return [() for _ in model.blocks]
    infos = module_infos(model)
    out = []
    seen: set[int] = set()  # a tied tensor (GPT-2's wte / lm_head) is held once
    for index, block in enumerate(model.blocks):
        pairs: list[tuple[float, int]] = []
        for sub, module in block.named_modules():
            path = f"blocks.{index}" + (f".{sub}" if sub else "")
            style, info = styles.get(path), infos.get(path)
            for pname, param in module.named_parameters(recurse=False):
                if id(param) in seen:
                    continue
                seen.add(id(param))
                divisor = 1
                if style is not None and info is not None:
                    divisor = _divisor(style, info, pname)
                pairs.append((float(param.numel() * param.element_size()), max(divisor, 1)))
        out.append(tuple(pairs))
    return out


def layer_styles(view: BlockModel, styles: dict[str, str] | None) -> dict[str, str] | None:
    """The whole model's plan ``styles`` on the layer view ([Note: layer view] in
    measure/layer_stats.py), as the runtime applies it to each stage
    (`core.tensor_parallel.parallelize_layer_stage`): a view block's stage keeps the model's
    paths under ``stage.``, and only the modules whose parameters the stage owns are split
    (the rest run replicated in its discarded part)."""
    if styles is None:
        return None
    out: dict[str, str] = {}
    for index, block in enumerate(view.blocks):
        for sub, module in block.named_modules():
            name = sub.removeprefix("stage.")
            if name in styles and any(True for _ in module.parameters(recurse=False)):
                out[f"blocks.{index}.{sub}"] = styles[name]
    return out


def layer_ties(
    model: BlockModel, view: BlockModel, styles: dict[str, str] | None
) -> list[tuple[tuple[str, float, int], ...]]:
    """Per layer-view block, (name, bytes, divisor) of each parameter it holds that is one tensor
    of ``model`` under several names (GPT-2's ``wte`` / ``lm_head``), named by its first name in
    ``model``: two stages on one rank hold such a tensor once ([Note: several layer stages per
    rank] in pipeline.layer_stage). ``styles``: the view's plan (`layer_styles`)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    canonical = {n: group[0] for group in names.values() if len(group) > 1 for n in group}
    infos = module_infos(view)
    out = []
    for index, block in enumerate(view.blocks):
        ties: list[tuple[str, float, int]] = []
        for sub, module in block.named_modules():
            path = f"blocks.{index}" + (f".{sub}" if sub else "")
            style, info = (styles or {}).get(path), infos.get(path)
            for pname, param in module.named_parameters(recurse=False):
                full = (f"{sub}." if sub else "") + pname
                tie = canonical.get(full.removeprefix("stage."))
                if tie is None:
                    continue
                divisor = _divisor(style, info, pname) if style and info else 1
                ties.append((tie, float(param.numel() * param.element_size()), max(divisor, 1)))
        out.append(tuple(ties))
    return out


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, list | tuple):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _float_bytes(value: Any) -> float:
    t = _first_tensor(value)
    if t is None or not t.is_floating_point():
        return 0.0  # token ids: no gradient, nothing reduced
    return float(t.numel() * t.element_size())


class TPModules:
    """[Note: tensor-parallel modules] The modules of one block that the plan ``styles``
    parallelizes, with their input's and output's bytes as one forward of ``batch`` samples
    sees them (forward hooks), as `TPModule` rows in the block's module order."""

    def __init__(self, block: nn.Module, prefix: str, styles: dict[str, str], batch: int) -> None:
        self.batch = batch
        self.rows: dict[str, TPModule] = {}
        self.handles = []
        infos = module_infos(block)
        for sub, module in block.named_modules():
            style = styles.get(prefix + (f".{sub}" if sub else ""))
            info = infos.get(sub)
            if style is None or info is None:
                continue
            tensors = len(list(module.parameters(recurse=False)))
            divisor = max(_divisor(style, info), 1)
            linear = (info.in_dim, info.out_dim) if info.kind == "linear" else (0, 0)

            def hook(
                module: nn.Module,
                inputs: Any,
                output: Any,
                key: str = sub,
                style: str = style,
                divisor: int = divisor,
                tensors: int = tensors,
                linear: tuple[int, int] = linear,
            ) -> None:
                self.rows[key] = TPModule(
                    style,
                    divisor,
                    tensors,
                    _float_bytes(inputs) / self.batch,
                    _float_bytes(output) / self.batch,
                    linear,
                )

            self.handles.append(module.register_forward_hook(hook))

    def modules(self) -> tuple[TPModule, ...]:
        return tuple(self.rows.values())

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``value`` (an operator's arguments or results: tensors, lists, tuples,
    dicts)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)


class SplitActivations(TorchDispatchMode):
    """[Note: tensor-parallel activations] Which of a block's tensors a tensor-parallel plan
    splits. Megatron's plan (Korthikanti et al. 2022, sec. 4.1, eq. 2: ``sbh (10 + 24/t +
    5as/(ht))`` per layer) splits what lies between a column-parallel output and a
    row-parallel input (q, k, v, the attention's output, the MLP's hidden activations) and
    leaves whole what every rank computes in full: the layer norms' inputs and outputs (the
    column-parallel layers' inputs), the residual stream, the loss. The runtime's plan (``styles``:
    module path -> style, `core.tensor_parallel.resolve_tp_plan`) names the modules: the
    output of a ``colwise``/``qkv`` module is split, the output of any other planned module
    (``rowwise`` after its all-reduce, ``colwise_gather`` after its gather, ``vocab``) is
    whole, and every operator's result is split iff one of its tensor arguments is. Tensors are
    told apart by storage (`storage_key`: views share it); the tagged ones are kept referenced
    so no storage is freed and its identity reused while the block runs. A
    ``rowwise_split`` module slices a whole input inside itself: its saved input counts whole
    (a little high)."""

    def __init__(self, block: nn.Module, prefix: str, styles: dict[str, str]) -> None:
        super().__init__()
        self.split: set[int] = set()
        self.kept: list[torch.Tensor] = []
        self.handles = []
        for sub, module in block.named_modules():
            style = styles.get(prefix + (f".{sub}" if sub else ""))
            if style is not None:
                hook = self._mark if style in ("colwise", "qkv") else self._unmark
                self.handles.append(module.register_forward_hook(hook))

    def _mark(self, module: nn.Module, inputs: Any, output: Any) -> None:
        for t in tensors_in(output):
            self.split.add(storage_key(t))
            self.kept.append(t)

    def _unmark(self, module: nn.Module, inputs: Any, output: Any) -> None:
        for t in tensors_in(output):
            self.split.discard(storage_key(t))

    def is_split(self, tensor: torch.Tensor) -> bool:
        return storage_key(tensor) in self.split

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if any(self.is_split(t) for t in tensors_in((args, kwargs or {}))):
            for t in tensors_in(out):
                self.split.add(storage_key(t))
                self.kept.append(t)
        return out

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.kept.clear()

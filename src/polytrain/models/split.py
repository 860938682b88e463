"""Split a user's model at its repeated layers: which stage owns which parameter and buffer.

[Note: layer pipeline] A model that is one module (a transformers model) is pipelined over its
repeated layers (`models.blocks`): stage ``s`` runs layers ``[a, b)``. What runs before the
first layer (embeddings, masks, rotary tables) belongs to the first stage, what runs after the
last (final norm, pooler, head) to the last. "Before" and "after" are measured, not guessed:
one forward with hooks records when each module with parameters runs relative to the layers
(`trace_sides`). A tensor used on both sides (GPT-2's ``wte`` is also its ``lm_head``) is owned
by both end stages: a tie, whose gradients the pipeline sums across those stages' ranks before
the update, as Megatron does for its embeddings, so the copies stay equal (on one rank both
stages use one Parameter: [Note: several layer stages per rank] in pipeline.layer_stage).

Every rank holds the whole model (built from the seed); a stage keeps as parameters and
buffers only the entries it owns and turns the others into plain attributes
(`keep_owned`), so its ``state_dict`` and optimizer see exactly its share, under the model's
own names.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from polytrain.errors import ConfigError

__all__ = [
    "POST",
    "PRE",
    "LayerSplit",
    "counts_from_split_points",
    "keep_owned",
    "stage_keys",
    "tied_stages",
    "trace_sides",
]

PRE, POST = "pre", "post"


@dataclass(frozen=True)
class LayerSplit:
    """Which side of the layers each module with direct parameters or buffers runs on."""

    list_path: str  # the ModuleList of layers, relative to the user module
    num_layers: int
    sides: dict[str, set[str]]  # module path -> {"pre"}, {"post"} or both

    def layer_of(self, module_path: str) -> int | None:
        prefix = self.list_path + "." if self.list_path else ""
        if not module_path.startswith(prefix):
            return None
        head = module_path[len(prefix) :].split(".", 1)[0]
        return int(head) if head.isdigit() else None

    def owners(self, module_path: str, ranges: list[tuple[int, int]]) -> set[int]:
        """Stages that own the direct entries of the module at ``module_path``."""
        layer = self.layer_of(module_path)
        if layer is not None:
            return {s for s, (a, b) in enumerate(ranges) if a <= layer < b}
        sides = self.sides.get(module_path, {PRE})  # never run: the first stage keeps it
        out: set[int] = set()
        if PRE in sides:
            out.add(0)
        if POST in sides:
            out.add(len(ranges) - 1)
        return out


def _direct(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(
        True for _ in module.buffers(recurse=False)
    )


@contextmanager
def _hooks(handles: list[Any]) -> Iterator[None]:
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def trace_sides(user: nn.Module, list_path: str, run: Callable[[], Any]) -> LayerSplit:
    """Run ``run()`` (one forward of ``user``) and record each module's side of the layers."""
    layers = user.get_submodule(list_path)
    assert isinstance(layers, nn.ModuleList)
    state = {"phase": PRE}
    sides: dict[str, set[str]] = {}
    handles: list[Any] = []
    prefix = list_path + "."

    def on_call(path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if state["phase"] != "in":
                sides.setdefault(path, set()).add(state["phase"])

        return hook

    def enter(module: nn.Module, args: Any) -> None:
        state["phase"] = "in"

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        state["phase"] = POST

    for path, module in user.named_modules():
        if path.startswith(prefix) or path == list_path or not _direct(module):
            continue
        handles.append(module.register_forward_pre_hook(on_call(path)))
    handles.append(layers[0].register_forward_pre_hook(enter))
    handles.append(layers[len(layers) - 1].register_forward_hook(leave))
    with _hooks(handles), torch.no_grad():
        run()
    return LayerSplit(list_path, len(layers), sides)


def keep_owned(
    user: nn.Module, split: LayerSplit, ranges: list[tuple[int, int]], stages: Collection[int]
) -> None:
    """Demote every parameter / buffer entry none of ``stages`` owns to a plain attribute.

    ``stages`` are the stages one rank holds (several under interleaved 1F1B and ZBV, all over
    the one model). An entry whose tensor they own under another name (a tie) keeps the same
    Parameter object, so the module that uses it still trains it; any other becomes a frozen
    detached copy (used only by the forward's discarded part, [Note: layer pipeline]).
    """
    owned: set[int] = set()
    for path, module in user.named_modules():
        if split.owners(path, ranges) & set(stages):
            owned.update(id(p) for p in module.parameters(recurse=False))
    for path, module in user.named_modules():
        if split.owners(path, ranges) & set(stages):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            delattr(module, name)  # nn.Module drops the registration (and state_dict entry)
            keep: Any = param if id(param) in owned else param.detach().requires_grad_(False)
            object.__setattr__(module, name, keep)
        for name, buf in list(module.named_buffers(recurse=False)):
            delattr(module, name)
            object.__setattr__(module, name, buf)


def counts_from_split_points(
    user: nn.Module, layers: list[str], points: list[str], num_stages: int
) -> list[int]:
    """Layers per stage from ``pipeline.split_points`` (the layers where stages 2.. begin)."""
    if len(points) != num_stages - 1:
        raise ConfigError(
            f"pipeline.split_points = {points} has {len(points)} paths for {num_stages} "
            f"pipeline stages: give {num_stages - 1} (where stages 2.. begin)"
        )
    starts = [0]
    for point in points:
        if point not in layers:
            names = {n for n, _ in user.named_modules()}
            what = "is not one of the repeated layers" if point in names else "names no module"
            raise ConfigError(
                f"pipeline.split_points: {point!r} {what} of the model: use layer paths such "
                f"as {layers[1]!r} ... {layers[-1]!r}"
            )
        starts.append(layers.index(point))
    if starts != sorted(set(starts)) or starts[1] == 0:
        raise ConfigError(
            f"pipeline.split_points = {points}: the layers must be in increasing order and "
            f"after the first one ({layers[0]!r})"
        )
    return [b - a for a, b in zip(starts, [*starts[1:], len(layers)], strict=True)]


def tied_stages(
    user: nn.Module, split: LayerSplit, ranges: list[tuple[int, int]]
) -> list[tuple[nn.Parameter, set[int]]]:
    """Parameters owned by more than one stage, with those stages (GPT-2: ``wte`` on 0 and last)."""
    holders: dict[int, tuple[nn.Parameter, set[int]]] = {}
    for path, module in user.named_modules():
        for param in module.parameters(recurse=False):
            entry = holders.setdefault(id(param), (param, set()))
            entry[1].update(split.owners(path, ranges))
    return [(p, stages) for p, stages in holders.values() if len(stages) > 1]


def stage_keys(
    user: nn.Module, split: LayerSplit, ranges: list[tuple[int, int]], prefix: str
) -> list[list[str]]:
    """Every stage's ``state_dict`` keys (under ``prefix``), in the model's order."""
    out: list[list[str]] = [[] for _ in ranges]
    for key in user.state_dict():
        path = key.rpartition(".")[0]
        for s in sorted(split.owners(path, ranges)):
            out[s].append(prefix + key)
    return out

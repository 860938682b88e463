"""Profile a user model's repeated layers, for ``pipeline.partition = 'auto'`` of a layer pipeline.

The measuring half of PipeDream's partitioner (Narayanan et al. SOSP 2019, section 3.1) for a
model that is one module ([Note: layer pipeline] in `models.split`): its layers cannot run
alone, because the model's own forward computes what they take between them (masks, rotary
tables, position ids), so the model runs whole, as in one process, and hooks read the clock
at the layers' edges.

[Note: layer profile] One forward (model and loss) and one backward per repeat. Forward hooks
on every layer read the clock as it starts and as the last one ends; gradient hooks on the
layers' hidden states read it as each layer's backward starts (the last layer's output) and
ends (each layer's input: a tensor hook fires once its whole gradient is summed, i.e. after the
layer's residual branch too). Unit ``i`` of the profile is layer ``i``; what runs before the
first layer (embeddings, masks) is added to unit 0 and what runs after the last (final norm,
head, loss) to the last unit, because those parts stay on the first and last stage whatever the
partition, as do their parameters (`LayerSplit` sides; a tied tensor counts on both ends, as
both end stages hold it). One exception: every stage re-runs the part before the layers in
its forward (`LayerStage` runs the model's own forward and replaces that part's output), so its
forward time costs every stage alike and moves no boundary; only its backward is unit 0's.
The time between two layers' starts is the earlier layer's. Saved
activations are counted per unit with the same storage rule as `profile_blocks`. Nothing of
this changes training ([Note: profiling leaves no trace] in `pipeline.profile`).
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from polytrain._torch_private import storage_key
from polytrain.config.job import JobConfig
from polytrain.core.optim import build_optimizer
from polytrain.errors import PartitionError
from polytrain.models.base import BlockModel, Inputs
from polytrain.models.split import POST, PRE, LayerSplit
from polytrain.pipeline.partition import BlockProfile, optimizer_state_factor
from polytrain.pipeline.profile import (
    OptimizerFactory,
    leaves_no_trace,
    profile_clock,
    update_seconds,
)
from polytrain.pipeline.saved_tensors import storage_keys

__all__ = ["profile_job_layers", "profile_layers"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _hidden_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else kwargs.get("hidden_states")


def _hidden_out(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output
    return output[0] if isinstance(output, tuple | list) and output else None


def _nbytes(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0


class _Marks:
    """Clock readings of one forward and backward, in the order they happen.

    Forward: ``start``, ``layer_in[i]`` (layer ``i`` starts), ``last_out`` (the last layer
    ends), ``loss``. Backward: ``back`` (it starts), ``grad_out`` (the last layer's output
    gradient is ready), ``grad_in[i]`` (layer ``i``'s input gradient is ready), ``end``.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.start = self.last_out = self.loss = self.back = self.end = 0.0
        self.layer_in = [0.0] * n
        self.grad_out: float | None = None
        self.grad_in: list[float | None] = [None] * n

    def segments(self) -> tuple[list[float], list[float]]:
        """Forward and backward seconds of the pre part, each layer, and the post part."""
        n = self.n
        f_edges = [self.start, *self.layer_in, self.last_out, self.loss]
        forward = [b - a for a, b in itertools.pairwise(f_edges)]
        # backward in time order: post part, layer n-1, ..., layer 0, pre part; an edge whose
        # hook never fired (no gradient flows there) takes the next reading
        readings = [self.back, self.grad_out, *reversed(self.grad_in)]
        b_edges = [self.end]
        for value in reversed(readings):
            b_edges.append(value if value is not None else b_edges[-1])
        b_edges.reverse()
        times = [b - a for a, b in itertools.pairwise(b_edges)]
        backward = [times[-1], *reversed(times[1 : n + 1]), times[0]]
        return forward, backward


class _Hooks:
    """Forward hooks on the layers that take `_Marks` and attribute saved activations."""

    def __init__(
        self, layers: nn.ModuleList, clock: Callable[[], float], device: torch.device
    ) -> None:
        self.layers, self.clock, self.device = layers, clock, device
        self.marks = _Marks(len(layers))
        self.unit = 0  # 0: before the layers, i + 1: layer i, n + 1: after them
        # only the forward's calls count: a model with its own checkpointing re-runs layers
        # in backward
        self.in_forward = False
        self.sizes: list[tuple[int, int]] = [(0, 0)] * len(layers)  # input, output bytes
        self.handles: list[Any] = []

    def now(self) -> float:
        _sync(self.device)
        return self.clock()

    def install(self) -> None:
        for i, layer in enumerate(self.layers):
            self.handles.append(
                layer.register_forward_pre_hook(partial(self._enter, i), with_kwargs=True)
            )
            self.handles.append(layer.register_forward_hook(partial(self._leave, i)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def _grad_mark(self, layer: int | None) -> Callable[[torch.Tensor], None]:
        """A tensor hook reading the clock into this round's marks: layer ``i``'s input
        gradient, or (None) the last layer's output gradient."""
        marks = self.marks

        def hook(grad: torch.Tensor) -> None:
            if layer is None:
                marks.grad_out = self.now()
            else:
                marks.grad_in[layer] = self.now()

        return hook

    def _enter(self, i: int, module: nn.Module, args: Any, kwargs: Any) -> None:
        if not self.in_forward:
            return
        self.marks.layer_in[i] = self.now()
        self.unit = i + 1
        x = _hidden_in(args, kwargs)
        if isinstance(x, torch.Tensor) and x.requires_grad:
            x.register_hook(self._grad_mark(i))
        self.sizes[i] = (_nbytes(x), self.sizes[i][1])

    def _leave(self, i: int, module: nn.Module, args: Any, output: Any) -> None:
        if not self.in_forward:
            return
        y = _hidden_out(output)
        self.sizes[i] = (self.sizes[i][0], _nbytes(y))
        if i < len(self.layers) - 1:
            return
        self.unit = len(self.layers) + 1
        if isinstance(y, torch.Tensor) and y.requires_grad:
            y.register_hook(self._grad_mark(None))
        self.marks.last_out = self.now()


def _side_params(user: nn.Module, split: LayerSplit) -> tuple[list[nn.Parameter], ...]:
    """Parameters of the part before the layers and of the part after them (a tie in both)."""
    pre: dict[int, nn.Parameter] = {}
    post: dict[int, nn.Parameter] = {}
    for path, module in user.named_modules():
        if split.layer_of(path) is not None:
            continue
        sides = split.sides.get(path, {PRE})  # never run: the first stage keeps it
        for p in module.parameters(recurse=False):
            if PRE in sides:
                pre[id(p)] = p
            if POST in sides:
                post[id(p)] = p
    return list(pre.values()), list(post.values())


def _measure(
    model: BlockModel,
    sample: tuple[Inputs, torch.Tensor],
    hooks: _Hooks,
    warmup: int,
    repeats: int,
) -> tuple[list[float], list[float], list[int]]:
    """Median forward and backward seconds and saved bytes of the pre part, each layer and the
    post part (``n + 2`` units), from whole forwards and backwards of ``model``."""
    n = len(hooks.layers)
    inputs, targets = sample
    params = [p for p in model.parameters() if p.requires_grad]
    static = storage_keys(model.parameters()) | storage_keys(model.buffers())
    forward: list[list[float]] = [[] for _ in range(n + 2)]
    backward: list[list[float]] = [[] for _ in range(n + 2)]
    activation = [0] * (n + 2)
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:  # the storage rule of `count_saved_bytes`
        key = storage_key(t)
        if key not in static and key not in seen:
            seen.add(key)
            activation[hooks.unit] += t.untyped_storage().nbytes()
        return t

    for round_index in range(warmup + repeats):
        hooks.marks = marks = _Marks(n)
        counter = (
            torch.autograd.graph.saved_tensors_hooks(pack, _unpack)
            if round_index == 0
            else contextlib.nullcontext()
        )
        marks.start = hooks.now()
        hooks.unit, hooks.in_forward = 0, True
        with counter:
            loss = model.loss(model(inputs), targets)
        hooks.in_forward = False
        marks.loss = marks.back = hooks.now()
        if params and loss.requires_grad:
            torch.autograd.grad(loss, params, allow_unused=True)  # no .grad written
        marks.end = hooks.now()
        if round_index >= warmup:
            f, b = marks.segments()
            for k in range(n + 2):
                forward[k].append(f[k])
                backward[k].append(b[k])
    f_med = [statistics.median(v) for v in forward]
    b_med = [statistics.median(v) for v in backward]
    return f_med, b_med, activation


def profile_layers(
    model: BlockModel,
    split: LayerSplit,
    sample: tuple[Inputs, torch.Tensor],
    *,
    warmup: int = 2,
    repeats: int = 5,
    optimizer_factor: int = 2,
    optimizer: OptimizerFactory | None = None,
) -> list[BlockProfile]:
    """One `BlockProfile` per repeated layer of ``model`` on one micro-batch ``sample =
    (inputs, targets)`` ([Note: layer profile]): medians over ``repeats`` after ``warmup``
    runs; with ``optimizer`` (params -> optimizer), each layer's ``update_s`` as in
    `profile_blocks`."""
    if repeats < 1 or warmup < 0:
        raise PartitionError(f"profile repeats = {repeats}, warmup = {warmup}: need >= 1 and >= 0")
    user = model.blocks[0]
    layers = user.get_submodule(split.list_path)
    assert isinstance(layers, nn.ModuleList)
    n = len(layers)
    device = next(model.parameters()).device
    hooks = _Hooks(layers, profile_clock(device), device)
    with leaves_no_trace(model, device):
        hooks.install()
        try:
            f_med, b_med, activation = _measure(model, sample, hooks, warmup, repeats)
        finally:
            hooks.remove()
    pre, post = _side_params(user, split)
    units: list[list[nn.Parameter]] = [list(layer.parameters()) for layer in layers]
    units[0] = pre + units[0]
    units[-1] = units[-1] + post
    profiles = []
    for i, unit_params in enumerate(units):
        # [Note: layer profile]: the pre part's forward runs on every stage, so only its
        # backward (and its saved activations) is the first stage's alone
        fwd = [i + 1] + ([n + 1] if i == n - 1 else [])
        idx = [i + 1] + ([0] if i == 0 else []) + ([n + 1] if i == n - 1 else [])
        trainable = sum(_nbytes(p) for p in unit_params if p.requires_grad)
        update_s = 0.0
        if optimizer is not None and device.type != "meta":
            update_s = update_seconds(unit_params, optimizer, device, warmup, repeats)
        profiles.append(
            BlockProfile(
                forward_s=sum(f_med[k] for k in fwd),
                backward_s=sum(b_med[k] for k in idx),
                param_count=sum(p.numel() for p in unit_params),
                param_bytes=sum(_nbytes(p) for p in unit_params),
                grad_bytes=trainable,
                optimizer_bytes=optimizer_factor * trainable,
                activation_bytes=sum(activation[k] for k in idx),
                input_bytes=hooks.sizes[i][0],
                output_bytes=hooks.sizes[i][1],
                update_s=update_s,
            )
        )
    return profiles


def profile_job_layers(
    job: JobConfig, model: BlockModel, split: LayerSplit, sample: tuple[Inputs, torch.Tensor]
) -> list[BlockProfile]:
    """`profile_layers` with the job's optimizer (its state bytes and its update time)."""
    return profile_layers(
        model,
        split,
        sample,
        optimizer_factor=optimizer_state_factor(job.optim.name, job.optim.momentum),
        optimizer=partial(build_optimizer, cfg=job.optim),
    )

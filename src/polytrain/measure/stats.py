"""Model statistics for the planner: FLOPs and bytes per block, and optionally seconds.

The one torch-facing planner module besides `measure.calibrate`. It builds the job's model with
the project's own builder (`models.registry.build_model`) and walks its block view
(`models.base.BlockModel`) one block at a time, so a pipeline stage's cost is a sum over its
blocks. FLOPs come from torch's `FlopCounterMode`; activation bytes from `saved_tensors_hooks`
(what autograd keeps for backward), counted once per storage and excluding the parameters.

On the ``meta`` device (the default) nothing is allocated, so a model of any size is measured
without its memory. `measure=True` also times forward and backward per block on a real device.

Attention is counted as the kernel the job runs keeps it, O(T) on meta too ([Note: fused
attention's saved tensors] in measure/kernels.py); the rest of a block saves the same on every
device.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from polytrain.config.io import save_job
from polytrain.config.job import JobConfig
from polytrain.core.step import AUTOCAST_DTYPES, autocast
from polytrain.data.datasets import Dataset, DataSpec, TokenDataset, build_datasets
from polytrain.data.masking import MaskedTokenDataset
from polytrain.measure.kernels import AttentionCounter, OpCounter
from polytrain.measure.layer_stats import fsdp_units, layer_view
from polytrain.measure.meta_autocast import MetaAutocast
from polytrain.measure.ops_stats import count_ops
from polytrain.measure.tp_stats import (
    SplitActivations,
    TPModules,
    layer_styles,
    layer_ties,
    plan_styles,
    tensors_in,
    tp_shards,
)
from polytrain.models.base import BlockModel, Inputs, inputs_to
from polytrain.models.registry import BUILTINS, block_size_of, build_model
from polytrain.pipeline.saved_tensors import SavedBytes, count_saved_bytes, storage_keys
from polytrain.planner.types import BlockStats, ModelStats
from polytrain.planner.worker_memory import factory_import_bytes

__all__ = [
    "OpCounter",
    "SplitActivations",
    "held_data_bytes",
    "model_stats",
    "optimizer_state_per_param",
    "stats_of",
    "train_flops_per_sample",
]


_PROBE_BATCH = 2  # samples in the counting pass; per-sample figures divide by it


def optimizer_state_per_param(job: JobConfig) -> int:
    """Optimizer-state tensors the size of each parameter: AdamW keeps exp_avg and exp_avg_sq,
    SGD a momentum buffer only when momentum > 0."""
    if job.optim.name == "adamw":
        return 2
    return 1 if job.optim.momentum > 0 else 0


@contextmanager
def _counting(
    exclude: set[int], split: SplitActivations | None = None
) -> Iterator[tuple[FlopCounterMode, SavedBytes]]:
    # One saved-bytes counter for the profile, the runtime and the planner (pipeline/saved_tensors).
    tagging = split if split is not None else nullcontext()
    is_split = split.is_split if split is not None else None
    with (
        FlopCounterMode(display=False) as flops,
        count_saved_bytes(exclude, is_split, keep=True) as saved,
        tagging,
    ):
        yield flops, saved


class _LinearRows:
    """(fan_in, fan_out) of a block's Linear layers and the rows each sees per call."""

    def __init__(self, block: nn.Module) -> None:
        self.shapes: list[tuple[int, int]] = []
        self.rows = 0
        self.handles = [
            m.register_forward_hook(self._hook) for m in block.modules() if isinstance(m, nn.Linear)
        ]

    def _hook(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], _: object) -> None:
        assert isinstance(module, nn.Linear)
        self.shapes.append((module.in_features, module.out_features))
        self.rows = max(self.rows, inputs[0].numel() // module.in_features)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _heads(model: nn.Module) -> int:
    """The attention head count a tensor-parallel degree must divide (0 = no attention): the
    gcd over modules with a ``head_dim`` and a ``q`` projection (gpt's attention)."""
    counts = []
    for m in model.modules():
        head_dim, q = getattr(m, "head_dim", None), getattr(m, "q", None)
        if isinstance(head_dim, int) and isinstance(q, nn.Linear):
            counts.append(q.out_features // head_dim)
    return math.gcd(*counts) if counts else 0


def _rows(inputs: Inputs) -> int:
    """Samples in a batch of one input tensor or of named ones."""
    first = inputs if isinstance(inputs, torch.Tensor) else next(iter(inputs.values()))
    return first.shape[0]


def _fresh(h: Inputs) -> Inputs:
    """A block's input cut from what produced it, requiring grad when it is floating point, so
    what the block saves counts toward it alone (named inputs, a user model's integer ids and
    masks, pass as they are)."""
    if isinstance(h, torch.Tensor) and h.is_floating_point():
        return h.detach().requires_grad_(True)
    return h


def _call(block: nn.Module, h: Inputs) -> Any:
    """``block`` on one input, or on named inputs as keyword arguments (a user model's first
    block: ``model(input_ids=..., attention_mask=...)``, as `BlockModel.forward` calls it)."""
    return block(**h) if isinstance(h, dict) else block(h)


def _output_bytes(output: Any) -> int:
    """Bytes of the tensors in a block's output: a tensor, or a user model's ``ModelOutput``
    (a dict) or tuple."""
    return sum(t.numel() * t.element_size() for t in tensors_in(output))


def _params_and_bytes(block: nn.Module) -> tuple[int, int]:
    params = list(block.parameters())
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def stats_of(
    model: BlockModel,
    inputs: Inputs,
    targets: torch.Tensor,
    *,
    name: str = "model",
    tokens_per_sample: int = 1,
    optimizer_state: int = 2,
    optimizer: str = "adamw",
    fused_optimizer: bool = False,
    grad_clip: bool = True,
    shards: list[tuple[tuple[float, int], ...]] | None = None,
    data_bytes: int = 0,
    tp_styles: dict[str, str] | None = None,
    low_precision: torch.dtype | None = None,
) -> ModelStats:
    """Per-block statistics from one forward pass over ``inputs`` (B samples, any device).

    The loss is charged to the last block (it runs on the last pipeline stage). Each block gets
    a fresh input that requires grad, so a block's saved input counts toward that block only.
    ``tp_styles`` (module path -> tensor-parallel style) also counts what of the saved bytes
    every tensor-parallel rank holds whole (`SplitActivations`). ``low_precision``: the job's
    autocast dtype, applied to meta tensors ([Note: autocast on meta] in measure/meta_autocast.py).
    """
    batch = _rows(inputs)
    exclude = storage_keys(model.parameters())
    out: list[BlockStats] = []
    h = inputs
    last = len(model.blocks) - 1
    for index, block in enumerate(model.blocks):
        h = _fresh(h)
        linears = _LinearRows(block)
        split = SplitActivations(block, f"blocks.{index}", tp_styles) if tp_styles else None
        planned = TPModules(block, f"blocks.{index}", tp_styles or {}, batch)
        fwd_ops, bwd_ops = OpCounter(), OpCounter()
        # innermost, so the attention counter sees the cast q, k, v a kernel would save
        cast = MetaAutocast(low_precision) if low_precision is not None else nullcontext()
        try:
            with _counting(exclude, split) as (flops, saved), fwd_ops:
                with AttentionCounter(flops, fwd_ops, saved) as attention, cast:
                    y = _call(block, h)
                with cast:
                    result = model.loss(y, targets) if index == last else y
        finally:
            linears.close()
            planned.close()
            if split is not None:
                split.close()
        if result.requires_grad:  # backward outside the FLOP and saved-bytes counters
            grad = torch.ones_like(result)
            with bwd_ops:
                torch.autograd.backward(result, grad)
            block.zero_grad(set_to_none=True)
        # [Note: selective recomputation's statistics] in measure/ops_stats.py
        loss = (lambda y: model.loss(y, targets)) if index == last else None
        ops = count_ops(block, h, exclude, batch, loss, low_precision)
        params, param_bytes = _params_and_bytes(block)
        out.append(
            BlockStats(
                name=f"blocks.{index}",
                params=params,
                param_bytes=param_bytes,
                fwd_flops=flops.get_total_flops() / batch,
                saved_bytes=saved.bytes / batch,
                output_bytes=_output_bytes(y) / batch,
                linears=tuple(linears.shapes),
                rows_per_sample=max(linears.rows // batch, 1),
                tensors=len(list(block.parameters())),
                fwd_ops=fwd_ops.ops,
                bwd_ops=bwd_ops.ops,
                fwd_moved_bytes=fwd_ops.moved / batch,
                bwd_moved_bytes=bwd_ops.moved / batch,
                tp_shards=shards[index] if shards else (),
                saved_whole_bytes=(saved.bytes - saved.split_bytes) / batch if split else 0.0,
                tp_modules=planned.modules() if tp_styles is not None else None,
                attention=tuple((t, s, d, fl / batch) for t, s, d, fl in attention.calls),
                attention_counted=attention.counted / batch,
                fwd_elementwise=fwd_ops.per_sample(batch),
                bwd_elementwise=bwd_ops.per_sample(batch),
                **ops,
            )
        )
        if index < last:  # the last block's output may be a user model's ModelOutput
            h = y.detach()
    dtype_bytes = next(model.parameters()).element_size()
    return ModelStats(
        name=name,
        blocks=tuple(out),
        dtype_bytes=dtype_bytes,
        tokens_per_sample=tokens_per_sample,
        optimizer_state_per_param=optimizer_state,
        tp_divisor=_heads(model),
        optimizer=optimizer,
        fused_optimizer=fused_optimizer,
        grad_clip=grad_clip,
        data_bytes=data_bytes,
    )


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _time_blocks(
    model: BlockModel, inputs: Inputs, targets: torch.Tensor, repeats: int
) -> list[tuple[float, float]]:
    """Median (forward, backward) seconds of each block on ``inputs``' device (whole batch)."""
    sync = torch.cuda.synchronize if targets.device.type == "cuda" else (lambda: None)
    out: list[tuple[float, float]] = []
    h = inputs
    last = len(model.blocks) - 1
    for index, block in enumerate(model.blocks):
        x = _fresh(h)

        def forward(block: nn.Module = block, x: Inputs = x, index: int = index) -> Any:
            y = _call(block, x)
            result = model.loss(y, targets) if index == last else y
            sync()
            return result

        forward()  # warm-up (allocator, kernels)
        fwd = _median_s(forward, repeats)
        y = _call(block, x)
        result = model.loss(y, targets) if index == last else y
        grad = None if index == last else torch.ones_like(result)

        def backward(result: torch.Tensor = result, grad: torch.Tensor | None = grad) -> None:
            torch.autograd.backward(result, grad, retain_graph=True)
            sync()

        backward()
        bwd = _median_s(backward, repeats)
        block.zero_grad(set_to_none=True)
        out.append((fwd, bwd))
        if index < last:
            h = y.detach()
    return out


def held_data_bytes(*datasets: Dataset) -> int:
    """Bytes of the storages behind ``datasets``' tensors, each storage once (the validation
    split is a view of the same token stream): what a worker holds for its data
    ([Note: a worker's own memory] in planner/memory.py)."""
    tensors: list[torch.Tensor] = []
    for ds in datasets:
        if isinstance(ds, TokenDataset | MaskedTokenDataset):
            tensors.append(ds.tokens)
        else:
            inputs = ds.inputs
            tensors += [ds.targets, *(inputs.values() if isinstance(inputs, dict) else [inputs])]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _label(job: JobConfig) -> str:
    """The model's name in a plan: a built-in with its size (``gpt-tiny``), a factory as named."""
    return f"{job.model.name}-{job.model.size}" if job.model.name in BUILTINS else job.model.name


def _split_fixed_saved(one: ModelStats, two: ModelStats, batch: int) -> ModelStats:
    """``one`` (counted at ``batch`` samples) with each block's saved bytes split into a
    per-sample slope and a batch-independent part, from ``two`` (counted at ``2 batch``);
    [Note: counted under autocast]. The layer view's blocks alike."""

    def split(ones: tuple[BlockStats, ...], twos: tuple[BlockStats, ...]) -> tuple[BlockStats, ...]:
        blocks = []
        for a, b in zip(ones, twos, strict=True):
            slope = max((b.saved_bytes * 2 * batch - a.saved_bytes * batch) / batch, 0.0)
            fixed = max(a.saved_bytes * batch - slope * batch, 0.0)
            ops: dict[str, Any] = {}
            if a.ops_kept_bytes is not None and b.ops_kept_bytes is not None:
                # the weight copies it saves are rebuilt (the fixed part, priced apart)
                ops = {
                    "ops_kept_bytes": max(2 * b.ops_kept_bytes - a.ops_kept_bytes, 0.0),
                    "ops_rebuilt_bytes": max(2 * b.ops_rebuilt_bytes - a.ops_rebuilt_bytes, 0.0),
                }
            blocks.append(
                replace(
                    a,
                    saved_bytes=slope,
                    saved_fixed_bytes=fixed,
                    saved_whole_bytes=min(b.saved_whole_bytes, slope),
                    **ops,
                )
            )
        return tuple(blocks)

    return replace(
        one,
        blocks=split(one.blocks, two.blocks),
        layer_blocks=split(one.layer_blocks, two.layer_blocks),
    )


def _counted(
    job: JobConfig, device: str, train_set: Dataset, val_set: Dataset, spec: DataSpec
) -> ModelStats:
    """`ModelStats` of ``job``'s model counted on ``device`` (`model_stats`)."""
    tokens = block_size_of(job.model) if spec.kind == "tokens" else 1
    with torch.device(device):
        model = build_model(job.model, spec, job.train.seed)
    # [Note: counted under autocast] On a real device the block passes run in the job's
    # autocast region, as the trainer runs them: a bf16 job saves bf16 matmul inputs and moves
    # half the bytes (on meta, which has no autocast, `MetaAutocast` applies its rules). Autocast also
    # saves a low-precision copy of each weight it casts, once per pass whatever the batch: the
    # count runs at two batch sizes and splits each block's saved bytes into a per-sample slope
    # (`saved_bytes`) and a fixed part (`saved_fixed_bytes`). Counted at one batch of 2, gpt
    # medium in bf16 showed 65 MiB per sample against 47 at a batch of 8.
    autocasts = device != "meta" and job.train.dtype != "fp32"
    # [Note: autocast on meta]: meta has no autocast; its operator lists are applied there
    low = AUTOCAST_DTYPES.get(job.train.dtype) if device == "meta" else None
    styles = plan_styles(model, job.model.name, list(job.parallel.tp_plan))
    shards = tp_shards(model, styles)
    data_bytes = held_data_bytes(train_set, val_set)

    common: dict[str, Any] = dict(
        name=_label(job),
        tokens_per_sample=tokens,
        optimizer_state=optimizer_state_per_param(job),
        optimizer=job.optim.name,
        fused_optimizer=job.optim.fused,
        grad_clip=job.optim.grad_clip > 0,
        data_bytes=data_bytes,
    )

    def count(batch: int) -> ModelStats:
        x, y = train_set.get(torch.arange(batch))
        inputs, targets = inputs_to(x, torch.device(device)), y.to(device)
        region = autocast(torch.device(device), job.train.dtype) if autocasts else nullcontext()
        with region:
            stats = stats_of(
                model, inputs, targets, shards=shards, tp_styles=styles, low_precision=low, **common
            )
            view = layer_view(job, spec, model, inputs)  # [Note: layer view]
            if view is None:
                return stats
            # the first stage runs from its context (the inputs), not from this argument
            first = torch.zeros(batch, dtype=torch.long, device=device)
            # tp inside a stage splits what the stage owns by the whole model's plan
            on_view = layer_styles(view, styles)
            layers = stats_of(
                view,
                first,
                targets,
                shards=tp_shards(view, on_view),
                tp_styles=on_view,
                low_precision=low,
                **common,
            )
        ties = layer_ties(model, view, on_view)
        blocks = tuple(replace(b, tied=t) for b, t in zip(layers.blocks, ties, strict=True))
        return replace(stats, layer_blocks=blocks)

    stats = count(_PROBE_BATCH)
    if autocasts or low is not None:
        stats = _split_fixed_saved(stats, count(2 * _PROBE_BATCH), _PROBE_BATCH)
    return replace(stats, fsdp_units=fsdp_units(model))


def train_flops_per_sample(job: JobConfig, spec: DataSpec, train_set: Dataset) -> float | None:
    """Forward + backward FLOPs of one sample of ``job``'s model as the planner counts them
    (`ModelStats.train_flops`, from `stats_of` over its block view on a probe batch of
    ``train_set``): what MFU divides by the peak. Counted on the meta device, so it costs no
    memory and little time whatever the model's size; None when the forward cannot run there
    ([Note: data-dependent forwards]): counting on a real device would build the model again."""
    meta = torch.device("meta")
    with meta:
        model = build_model(job.model, spec, job.train.seed)
    x, y = train_set.get(torch.arange(_PROBE_BATCH))
    try:
        stats = stats_of(model, inputs_to(x, meta), y.to(meta))
    except Exception:  # data-dependent code (e.g. .item()) cannot run on meta, as in pre-flight
        return None
    return stats.train_flops


def model_stats(
    job: JobConfig,
    *,
    device: str = "meta",
    measure: bool = False,
    measure_device: str = "cpu",
    batch: int = 8,
    repeats: int = 5,
    threads: int | None = 1,
    imports: bool = True,
) -> ModelStats:
    """`ModelStats` of ``job``'s model: counted on ``device`` (attention as the job's kernel
    keeps it on every device: [Note: fused attention's saved tensors] in measure/kernels.py);
    with ``measure``, forward/backward seconds per sample from a batch of ``batch`` on
    ``measure_device`` with ``threads`` intra-op threads (workers run one each). For a user's
    model factory, ``imports`` also reads what it adds to a worker's memory in a fresh
    interpreter (`ModelStats.import_bytes`, a few seconds)."""
    block_size = block_size_of(job.model)
    train_set, val_set, spec = build_datasets(job.data, block_size)
    try:
        stats = _counted(job, device, train_set, val_set, spec)
    except RuntimeError as exc:
        # [Note: data-dependent forwards] A forward that reads tensor values (transformers
        # builds BERT's or Llama's attention mask from the ``attention_mask`` values) cannot
        # run on meta: count on the CPU instead, where the model must then fit.
        if device != "meta" or "meta" not in str(exc):
            raise
        stats = _counted(job, "cpu", train_set, val_set, spec)
    if imports and job.model.name not in BUILTINS:
        with tempfile.TemporaryDirectory(prefix="polytrain-stats-") as tmp:
            save_job(job, f"{tmp}/job.toml")
            stats = replace(stats, import_bytes=factory_import_bytes(f"{tmp}/job.toml"))
    if not measure:
        return stats
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        real = build_model(job.model, spec, job.train.seed).to(measure_device)
        xb, yb = train_set.get(torch.arange(batch))
        here = torch.device(measure_device)
        inputs, targets = inputs_to(xb, here), yb.to(here)
        times = _time_blocks(real, inputs, targets, repeats)
        view = layer_view(job, spec, real, inputs) if stats.layer_blocks else None
        first = torch.zeros(batch, dtype=torch.long, device=here)  # see `_counted`
        # (a model too large to copy once per layer here keeps its layer blocks untimed)
        layer_times = _time_blocks(view, first, targets, repeats) if view is not None else None
    finally:
        torch.set_num_threads(old_threads)

    def timed(blocks: tuple[BlockStats, ...], seconds: list[tuple[float, float]]) -> Any:
        return tuple(
            replace(b, fwd_s=fwd / batch, bwd_s=bwd / batch)
            for b, (fwd, bwd) in zip(blocks, seconds, strict=True)
        )

    return replace(
        stats,
        blocks=timed(stats.blocks, times),
        layer_blocks=(
            timed(stats.layer_blocks, layer_times)
            if layer_times is not None
            else stats.layer_blocks
        ),
    )

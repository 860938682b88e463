"""Pre-flight checks of a user's model against the job (docs/models.md): no processes, meta device.

Each finding is one line: a `ConfigError` (the CLI exits 2) for a combination that would train
wrong or crash later, or a printed warning where the user asked for it explicitly.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from polytrain.config.job import JobConfig
from polytrain.errors import ConfigError, PolytrainError
from polytrain.models.base import BlockModel

__all__ = ["BATCHNORMS", "check_model", "has_batchnorm", "tied_parameters"]

# torch's batch-norm layers (their shared base class is private).
BATCHNORMS: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
)


def tied_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one tensor (e.g. GPT-2's ``wte`` and ``lm_head``)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, BATCHNORMS) for m in model.modules())


def _warn(message: str) -> None:
    """On stderr, so that `--dry-run`'s stdout stays the job's TOML."""
    print(f"polytrain: warning: {message}", file=sys.stderr, flush=True)


def _check_layout(job: JobConfig, model: BlockModel, named_inputs: bool) -> None:
    p = job.parallel
    ties = tied_parameters(model)
    layer_pipeline = p.pp > 1 and bool(model.layers)  # [Note: layer pipeline] in models.split
    # Under tensor parallel a tie is kept (core.tp_styles.retie) when the plan splits the
    # shared tensor alike in every module that uses it (checked with the plan).
    if ties and p.pp > 1 and not layer_pipeline:
        n = len(model.user_prefix)
        names = [k[n:] if k.startswith(model.user_prefix) else k for k in ties[0]]
        raise ConfigError(
            f"the model ties {' and '.join(names)} (one shared tensor), and parallel.pp = "
            f"{p.pp} would keep separate copies that drift apart: train it with dp / zero / "
            "ps / tp, or untie the weights in the model"
        )
    if layer_pipeline:
        _check_layer_pipeline(job, model)
    if job.pipeline.split_points and not layer_pipeline:
        raise ConfigError(
            f"pipeline.split_points = {job.pipeline.split_points} applies to a pipeline over a "
            "user model's repeated layers; for this model use pipeline.partition (blocks per "
            "stage)"
        )
    if named_inputs and p.pp > 1 and not layer_pipeline:
        raise ConfigError(
            f"named inputs (a .safetensors data set with several input tensors) with "
            f"parallel.pp = {p.pp}: pipeline stages pass one tensor; use dp / zero / ps"
        )
    # With one micro-batch the stages' BatchNorms are synchronised over dp ([Note: BatchNorm
    # parity] in core.batchnorm); with several, no schedule can match one process.
    if has_batchnorm(model) and p.pp > 1 and job.pipeline.microbatches > 1:
        message = (
            f"BatchNorm with parallel.pp = {p.pp} and pipeline.microbatches = "
            f"{job.pipeline.microbatches}: each micro-batch is normalised with its own "
            "statistics, so the run cannot match one process (docs/models.md)"
        )
        if job.model.batchnorm != "local":
            raise ConfigError(
                f"{message}; set model.batchnorm = 'local' to accept that, or use "
                "pipeline.microbatches = 1"
            )
        _warn(message)


def _check_layer_pipeline(job: JobConfig, model: BlockModel) -> None:
    """What a pipeline over a user model's layers does not offer yet (one line each)."""
    pl = job.pipeline
    if pl.schedule == "pipedream":  # weight stashing swaps whole blocks' weights (LayerStage)
        raise ConfigError(
            f"pipeline.schedule = 'pipedream' with a pipeline over the layers of model.name = "
            f"{job.model.name!r}: not supported for a user's model yet; use gpipe or 1f1b"
        )
    # The stage count and split points are checked with the pipeline (pipeline.family): the
    # stages are pp x the schedule's stages per rank.


def _check_output(job: JobConfig, model: BlockModel, sample: tuple[Any, torch.Tensor]) -> None:
    """Run the model on a meta-device sample: its output and loss must fit the contract."""
    x, y = sample
    x = {k: v.to("meta") for k, v in x.items()} if isinstance(x, dict) else x.to("meta")
    try:
        with torch.no_grad():
            output = model(x)
    except PolytrainError:
        raise
    except Exception:  # data-dependent code (e.g. .item()) cannot run on meta: checked at run time
        return
    model.loss(output, y.to("meta"))  # raises the contract's one-line errors


CONVS: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _check_channels(job: JobConfig, model: BlockModel, sample: tuple[Any, torch.Tensor]) -> None:
    """Images must have the channels the model's first convolution takes.

    Checked here because a wrong channel count (grey images for an RGB model, channels-last
    arrays) would otherwise fail on every worker with a shape error deep in the forward. The
    first convolution in module order is taken as the one that reads the images; an input of
    another rank (not (B, C, *spatial)) is left to the run.
    """
    x = sample[0]
    if isinstance(x, dict):
        x = x.get("pixel_values", x.get("inputs"))
    conv = next(((n, m) for n, m in model.named_modules() if isinstance(m, CONVS)), None)
    if not isinstance(x, torch.Tensor) or conv is None:
        return
    name, module = conv
    assert isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d)
    spatial = len(module.kernel_size)
    if x.dim() != spatial + 2 or x.size(1) == module.in_channels:
        return
    n = len(model.user_prefix)
    shown = name[n:] if name.startswith(model.user_prefix) else name
    raise ConfigError(
        f"data.source = {job.data.source!r} has images of shape {tuple(x.shape[1:])} with "
        f"{x.size(1)} channel(s), but the model's first convolution {shown!r} takes "
        f"{module.in_channels}: store the images as (N, {module.in_channels}, ...) channels "
        "first, or build the model for the data's channels (spec.input_shape[0])"
    )


def check_model(job: JobConfig, model: BlockModel, sample: tuple[Any, torch.Tensor]) -> None:
    """The contract checks for ``model`` (built on the meta device) and one batch of the data."""
    _check_layout(job, model, isinstance(sample[0], dict))
    _check_channels(job, model, sample)
    if job.model.name not in ("gpt", "mlp", "cnn", "resnet") or job.model.loss != "auto":
        _check_output(job, model, sample)


def check_vocabulary(job: JobConfig, model: BlockModel, vocab_size: int) -> None:
    """Token data's ids index the model's first embedding table (in module order): a table
    smaller than the data's vocabulary would fail on every worker with an index error."""
    table = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if table is None or table.num_embeddings >= vocab_size:
        return
    raise ConfigError(
        f"data.source = {job.data.source!r} has a vocabulary of {vocab_size} (data.tokenizer = "
        f"{job.data.tokenizer!r}) and the model's embedding table holds {table.num_embeddings}: "
        "build the model with spec.vocab_size, or use the tokenizer the model was made for"
    )


def check_objective(job: JobConfig, model: BlockModel) -> None:
    """A transformers model made for one objective trained on another trains, but not as its
    user meant (a BERT on next-token targets): a warning naming the fix."""
    name = type(model.blocks[0]).__name__ if model.user_prefix else ""
    objective = job.data.objective
    if objective == "causal" and name.endswith("ForMaskedLM"):
        _warn(
            f"{name} is a masked language model and data.objective = 'causal' trains it on "
            "next-token targets: set data.objective = 'mlm' (--set data.objective=mlm)"
        )
    if objective == "mlm" and name.endswith(("ForCausalLM", "LMHeadModel")):
        _warn(
            f"{name} is a causal language model and data.objective = 'mlm' trains it on masked "
            "tokens: set data.objective = 'causal'"
        )

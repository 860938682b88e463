"""Build the model a job names: a built-in (``gpt``, ``mlp``) or a user factory.

A user factory is ``package.module:function``; it is called with the `DataSpec` and returns an
``nn.Module``. A `BlockModel` is used as it is; an ``nn.Sequential`` becomes one block per child;
any other module is a single block. The loss is the module's ``loss(output, target)`` method if it
has one, else cross-entropy.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from polytrain.config.job import ModelConfig
from polytrain.data.datasets import DataSpec
from polytrain.errors import ConfigError
from polytrain.models import gpt, mlp
from polytrain.models.base import BlockModel, cross_entropy_loss

__all__ = ["BUILTINS", "build_model", "model_dims", "resolve_factory"]

BUILTINS = ("gpt", "mlp")


def resolve_factory(name: str) -> Callable[[DataSpec], nn.Module]:
    """Import ``package.module:function`` (a `ConfigError` that says why if it cannot)."""
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"model.name = {name!r} is not a built-in model ({', '.join(BUILTINS)}) nor a "
            "factory of the form 'package.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"model.name = {name!r}: cannot import module {module_name!r} ({exc}); check "
            "the spelling and that it is on PYTHONPATH"
        ) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"model.name = {name!r}: module {module_name!r} has no callable {attr!r}")
    return factory


def model_dims(cfg: ModelConfig) -> dict[str, Any]:
    """The named size with explicit fields laid over it."""
    sizes = gpt.SIZES if cfg.name == "gpt" else mlp.SIZES
    if cfg.size not in sizes:
        raise ConfigError(f"model.size = {cfg.size!r}: expected one of {', '.join(sizes)}")
    dims: dict[str, Any] = dict(sizes[cfg.size])
    for key in ("n_layer", "n_embd", "n_head", "block_size"):
        value = getattr(cfg, key)
        if value is not None:
            dims[key] = value
    return dims


def block_size_of(cfg: ModelConfig) -> int:
    """Context length the data windows must have (built-ins' size, or 64 for user models)."""
    if cfg.name in BUILTINS:
        return int(model_dims(cfg)["block_size"])
    return cfg.block_size or 64


def build_model(cfg: ModelConfig, spec: DataSpec, seed: int) -> BlockModel:
    """Build the model with weights that depend on ``seed`` only (never on the layout)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if cfg.name == "gpt":
            if spec.kind != "tokens":
                raise ConfigError(
                    "model.name = 'gpt' needs token data (text or a .npy token array), "
                    f"but data.source gives {spec.kind}"
                )
            dims = model_dims(cfg)
            return gpt.build_gpt(
                gpt.GPTConfig(vocab_size=spec.vocab_size, dropout=cfg.dropout, **dims)
            )
        if cfg.name == "mlp":
            dims = model_dims(cfg)
            return mlp.build_mlp(spec, dims["n_layer"], dims["n_embd"], dims["block_size"])
        module = resolve_factory(cfg.name)(spec)
    if isinstance(module, BlockModel):
        return module
    if not isinstance(module, nn.Module):
        raise ConfigError(
            f"model.name = {cfg.name!r} returned {type(module).__name__}, not an nn.Module"
        )
    blocks = list(module.children()) if isinstance(module, nn.Sequential) else [module]
    loss = getattr(module, "loss", None)
    return BlockModel(blocks, loss if callable(loss) else cross_entropy_loss)

"""Build the model a job names: a built-in (``gpt``, ``mlp``, ``cnn``, ``resnet``) or a user
factory.

A user factory is ``package.module:function``; it is called as ``factory(spec, **model.args)``
with the `DataSpec` and returns an ``nn.Module`` (docs/models.md). A `BlockModel` is used as it
is; an ``nn.Sequential`` becomes one block per child; any other module is a single block whose
repeated layers are found (`models.blocks`). The loss is the module's ``loss(output, target)``
method if it has one, else ``model.loss`` (`models.contract`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from polytrain.config.job import ModelConfig
from polytrain.data.datasets import DataSpec
from polytrain.errors import ConfigError, PolytrainError
from polytrain.models import cnn, gpt, mlp
from polytrain.models.base import BlockModel
from polytrain.models.blocks import layer_paths
from polytrain.models.contract import import_callable, resolve_loss

__all__ = ["BUILTINS", "build_model", "model_dims", "resolve_factory"]

BUILTINS = ("gpt", "mlp", "cnn", "resnet")

_SIZES: dict[str, dict[str, dict[str, int]]] = {
    "gpt": gpt.SIZES,
    "mlp": mlp.SIZES,
    "cnn": cnn.CNN_SIZES,
    "resnet": cnn.RESNET_SIZES,
}


def resolve_factory(name: str) -> Callable[..., nn.Module]:
    """Import ``package.module:function`` (a `ConfigError` that says why if it cannot)."""
    if ":" not in name:
        raise ConfigError(
            f"model.name = {name!r} is not a built-in model ({', '.join(BUILTINS)}) nor a "
            "factory of the form 'package.module:function'"
        )
    return import_callable(name, "model.name")


def _check_factory_fields(cfg: ModelConfig) -> None:
    """Size fields belong to the built-ins; a factory takes its own in ``model.args``."""
    given = [k for k in ("n_layer", "n_embd", "n_head") if getattr(cfg, k) is not None]
    given += ["size"] if cfg.size != "tiny" else []
    given += ["dropout"] if cfg.dropout else []
    if given:
        key = given[0]
        raise ConfigError(
            f"model.{key} = {getattr(cfg, key)!r} applies to the built-in models only, and "
            f"model.name = {cfg.name!r} is a factory: pass it as model.args.{key} (keyword "
            "arguments of the factory) or leave it out"
        )


def _call_factory(cfg: ModelConfig, spec: DataSpec) -> nn.Module:
    factory = resolve_factory(cfg.name)
    try:
        module = factory(spec, **cfg.args)
    except PolytrainError:
        raise
    except Exception as exc:  # the user's code: any failure becomes one line
        where = ""
        if torch.get_default_device().type == "meta":
            where = (
                " while pre-flight built it on the meta device (no memory, no values): avoid "
                "reading tensor values (.item(), .tolist(), data-dependent control flow) in "
                "the model's constructor"
            )
        detail = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError(
            f"model.name = {cfg.name!r} raised {type(exc).__name__}({detail!r}){where}; "
            f"model.args = {cfg.args!r}"
        ) from None
    if not isinstance(module, nn.Module):
        raise ConfigError(
            f"model.name = {cfg.name!r} returned {type(module).__name__}, not an nn.Module"
        )
    return module


def model_dims(cfg: ModelConfig) -> dict[str, Any]:
    """The named size with explicit fields laid over it."""
    sizes = _SIZES.get(cfg.name, mlp.SIZES)
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
        if cfg.name in BUILTINS:
            if cfg.args:
                raise ConfigError(
                    f"model.args = {cfg.args!r} is for factories, and model.name = "
                    f"{cfg.name!r} is a built-in: use model.n_layer, model.n_embd, ... instead"
                )
            model = _build_builtin(cfg, spec)
            if cfg.loss != "auto":
                model.loss_fn = resolve_loss(cfg.loss, spec.classification)
            return model
        _check_factory_fields(cfg)
        module = _call_factory(cfg, spec)
    if isinstance(module, BlockModel):
        return module
    loss = getattr(module, "loss", None)
    loss_fn = loss if callable(loss) else resolve_loss(cfg.loss, spec.classification)
    if isinstance(module, nn.Sequential):
        return BlockModel(list(module.children()), loss_fn, user_prefix="blocks.")
    return BlockModel([module], loss_fn, user_prefix="blocks.0.", layers=layer_paths(module))


def _build_builtin(cfg: ModelConfig, spec: DataSpec) -> BlockModel:
    if cfg.name == "gpt":
        if spec.kind != "tokens":
            raise ConfigError(
                "model.name = 'gpt' needs token data (text or a .npy token array), "
                f"but data.source gives {spec.kind}"
            )
        dims = model_dims(cfg)
        return gpt.build_gpt(gpt.GPTConfig(vocab_size=spec.vocab_size, dropout=cfg.dropout, **dims))
    dims = model_dims(cfg)
    if cfg.name == "cnn":
        return cnn.build_cnn(spec, dims["n_layer"], dims["n_embd"], dims["channels"], cfg.dropout)
    if cfg.name == "resnet":
        return cnn.build_resnet(spec, dims["n_layer"], dims["n_embd"])
    return mlp.build_mlp(spec, dims["n_layer"], dims["n_embd"], dims["block_size"])

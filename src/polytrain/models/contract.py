"""The model contract: what a user's model may return, and the loss polytrain applies to it.

A model's forward may return a tensor (the predictions), a dict, or a transformers
``ModelOutput`` (itself an ordered dict). From a mapping the model's own ``loss`` is used when it
holds one (the model was given labels among its inputs), otherwise its ``logits`` go through the
job's loss. ``model.loss`` is ``cross_entropy``, ``mse`` or a factory ``package.module:function``
taking ``(predictions, targets)`` and returning a scalar; ``auto`` picks by the targets' dtype:
integer targets are class indices (cross-entropy), float targets are values (mean squared error).
See docs/models.md.

Shapes: B batch, V classes or outputs, ``...`` any further dims (time, pixels).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from polytrain.errors import ConfigError

__all__ = [
    "LOSSES",
    "ContractLoss",
    "import_callable",
    "mse_loss",
    "predictions",
    "resolve_loss",
    "top1_correct",
]

LOSSES = ("auto", "cross_entropy", "mse")


IGNORE = -100  # a target position that is not predicted (masked LM: the unmasked tokens)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every predicted position: logits (..., V), targets (...);
    positions whose target is `IGNORE` are left out (masked language modelling)."""
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=IGNORE
    )


def mse_loss(predictions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error; predictions (B, 1) against targets (B,) are compared as (B,)."""
    if predictions.dim() == targets.dim() + 1 and predictions.size(-1) == 1:
        predictions = predictions.squeeze(-1)
    return F.mse_loss(predictions.float(), targets.float())


def import_callable(name: str, what: str) -> Callable[..., Any]:
    """Import ``package.module:function`` the way ``python -m`` would see it.

    [Note: the current directory] ``python -m polytrain`` puts the current directory first on
    ``sys.path``; the ``polytrain`` console script does not, so a ``my_model.py`` beside the job
    would be found by one and not the other. The current directory is put first here, as
    ``python -m`` does, so both find it.
    """
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{what} = {name!r} is not of the form 'package.module:function'")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = exc.name or ""  # the module that was not found ("" where Python does not say)
        if not missing or module_name == missing or module_name.startswith(missing + "."):
            raise ConfigError(
                f"{what} = {name!r}: cannot import module {module_name!r} ({exc}); check "
                "the spelling and that it is on PYTHONPATH or in the current directory"
            ) from exc
        raise ConfigError(  # the module was found; something it imports was not
            f"{what} = {name!r}: module {module_name!r} was found but importing it failed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    except Exception as exc:  # a module that raises while it runs (SyntaxError, NameError...)
        raise ConfigError(
            f"{what} = {name!r}: importing module {module_name!r} raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    target: Any = module
    for part in attr.split("."):
        target = getattr(target, part, None)
    if not callable(target):
        raise ConfigError(f"{what} = {name!r}: module {module_name!r} has no callable {attr!r}")
    return target


def predictions(output: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(predictions, own_loss)`` of a forward's output; at most one of them is used.

    A tuple (transformers with ``return_dict=False``) counts as its first element. Raises a
    `ConfigError` naming the keys when a mapping holds neither ``logits`` nor ``loss``.
    """
    if isinstance(output, torch.Tensor):
        return output, None
    if isinstance(output, Mapping):
        loss = output.get("loss")
        if isinstance(loss, torch.Tensor):
            return None, loss
        logits = output.get("logits")
        if isinstance(logits, torch.Tensor):
            return logits, None
        keys = [k for k, v in output.items() if v is not None]
        raise ConfigError(
            f"the model returned {type(output).__name__} with keys {keys}: it needs 'logits' "
            "(its predictions) or 'loss' (pass labels among the inputs); return one of them or "
            "a tensor"
        )
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0], None
    raise ConfigError(
        f"the model returned {type(output).__name__}: expected a tensor, a dict or a "
        "ModelOutput with 'logits' or 'loss'"
    )


class ContractLoss:
    """``loss(output, targets)`` for any output the contract allows; checks the result is a scalar."""

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], name: str):
        self.fn, self.name = fn, name

    def __call__(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        preds, own = predictions(output)
        if own is not None:
            value = own
            what = "the model's own loss"
        else:
            assert preds is not None
            value = self.fn(preds, targets)
            what = f"model.loss = {self.name!r}"
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ConfigError(
                f"{what} returned {shape}, not a scalar: reduce it (e.g. .mean()) so the loss "
                "is one number per batch"
            )
        return value.reshape(())


def resolve_loss(name: str, classification: bool) -> ContractLoss:
    """The loss ``model.loss`` names; ``auto`` follows the targets (integer: cross-entropy)."""
    if name == "auto":
        name = "cross_entropy" if classification else "mse"
    if name == "cross_entropy":
        return ContractLoss(cross_entropy, name)
    if name == "mse":
        return ContractLoss(mse_loss, name)
    if ":" not in name:
        raise ConfigError(
            f"model.loss = {name!r}: expected one of {', '.join(LOSSES)} or a function "
            "'package.module:function' taking (predictions, targets)"
        )
    return ContractLoss(import_callable(name, "model.loss"), name)


def top1_correct(output: Any, targets: torch.Tensor) -> torch.Tensor | None:
    """How many rows' highest-scoring class equals the integer target, as a float tensor;
    None when the output is no (B, K) class scores for (B,) class targets (e.g. token data,
    regression, or a model that returned only its own loss)."""
    preds, _ = predictions(output)
    if preds is None or targets.is_floating_point() or targets.dim() != 1:
        return None
    if preds.dim() != 2 or preds.size(0) != targets.size(0):
        return None
    return (preds.argmax(dim=-1) == targets).sum().float()

"""A strategy's state as named full tensors, and back: the DCP state-dict half of
[Note: checkpoint format] in `trainer.checkpoint` (the storage half stays there)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from polytrain.core.strategy import Strategy

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

__all__ = ["CheckpointParts"]


def _options() -> StateDictOptions:
    """DCP's state-dict API is imported where it is called, not at the top: it brings FSDP and
    DTensor, which the launcher and a worker's start need not load ([Note: lazy
    torch.distributed])."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True)


class CheckpointParts:
    """The strategy's modules as one module, and the map between its keys and ours.

    One module is used as it is. Several (interleaved pipeline stages on one rank) are put in
    an ``nn.ModuleList`` so one ``get_state_dict`` call covers them and their optimizer; its
    ``<j>.`` prefix is stripped, since the modules' own keys (``blocks.<i>...``) are disjoint.
    """

    def __init__(self, strategy: Strategy) -> None:
        modules, optimizer = strategy.checkpoint_parts()
        self.multi = len(modules) > 1
        self.module: nn.Module = nn.ModuleList(modules) if len(modules) != 1 else modules[0]
        # A rank without model parts (a parameter server before it exposes its shard) has no
        # state of its own to save; an optimizer over parameters outside the modules cannot be
        # named, so it is left out too.
        self.optimizer = optimizer if modules else None

    def _strip(self, key: str) -> str:
        return key.split(".", 1)[1] if self.multi else key

    def _live(self) -> tuple[dict[str, Any], dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return dict(get_model_state_dict(self.module, options=_options())), {}
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer, options=_options())
        return dict(model_sd), dict(optim_sd)

    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Collective: the full (unsharded) state of this rank's parts under our keys
        (``model.<fqn>``, ``optim.<fqn>.<name>``), and its first parameter group's
        hyperparameters."""
        model_sd, optim_sd = self._live()
        flat = {"model." + self._strip(k): v for k, v in model_sd.items()}
        for fqn, entries in optim_sd.get("state", {}).items():
            for name, value in entries.items():
                flat[f"optim.{self._strip(fqn)}.{name}"] = value
        groups = optim_sd.get("param_groups", [])
        hyper = {k: v for k, v in groups[0].items() if k != "params"} if groups else {}
        return flat, hyper

    def load(self, fetch: Callable[[str, Any], Any]) -> None:
        """Collective: replace every live value ``v`` under our key ``k`` by ``fetch(k, v)``.

        The live optimizer keeps its own hyperparameters (the current job's)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if self.optimizer is not None:
            _init_optimizer_state(self.optimizer)
        model_sd, optim_sd = self._live()
        model_sd = {k: fetch("model." + self._strip(k), v) for k, v in model_sd.items()}
        if self.optimizer is None or not _has_tensor_state(optim_sd):
            # [Note: stateless optimizers] SGD without momentum keeps no tensor state; torch's
            # set_state_dict then finds no tensor to take a device from and fails ("Expected
            # device to be set"). There is nothing of the optimizer's to restore (its
            # hyperparameters are the current job's), so only the model is loaded.
            set_model_state_dict(self.module, model_sd, options=_options())
            return
        optim_sd["state"] = {
            fqn: {
                name: fetch(f"optim.{self._strip(fqn)}.{name}", value)
                for name, value in entries.items()
            }
            for fqn, entries in optim_sd["state"].items()
        }
        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict=model_sd,
            optim_state_dict=optim_sd,
            options=_options(),
        )


@torch.no_grad()
def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (one step with zero gradients and lr 0) if it has none.

    ``get_state_dict`` does this itself only when no parameter has a gradient; a parameter
    server's parameters always do (views of its flat gradient buffer), so without this its
    empty optimizer state would list no keys to load. The gradients are put back afterwards.
    """
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(p.grad is None for p in params):
        return  # get_state_dict initializes it
    grads = [p.grad for p in params]
    lrs = [group["lr"] for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    for p, g in zip(params, grads, strict=True):
        p.grad = g


def _has_tensor_state(optim_sd: dict[str, Any]) -> bool:
    """Whether an optimizer state dict holds any non-scalar tensor (see [Note: stateless
    optimizers])."""
    return any(
        isinstance(value, torch.Tensor) and value.dim() > 0
        for entries in optim_sd.get("state", {}).values()
        for value in entries.values()
    )

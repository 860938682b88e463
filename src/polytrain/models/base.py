"""`BlockModel`: a model as an ordered list of blocks plus a loss.

Pipelines cut the block list into stages, so every built-in model is written as blocks that take
one tensor and return one tensor. Parameter names are ``blocks.<i>.<...>`` whatever the layout,
which keeps exported weights comparable across strategies.

A user's model is wrapped as it is (docs/models.md): an ``nn.Sequential`` gives one block per
child, any other module is one block whose repeated layers (`models.blocks`) are the units of
ZeRO-3 and recomputation. Its inputs may be one tensor or several named ones (a dict, passed as
keyword arguments), and `export_state` gives its weights back under its own names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "BlockModel",
    "Inputs",
    "LossFn",
    "cross_entropy_loss",
    "inputs_to",
    "one_input",
    "to_device",
]

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
Inputs = torch.Tensor | dict[str, torch.Tensor]  # one tensor, or named ones (keyword arguments)


def one_input(x: Inputs) -> torch.Tensor:
    """The one input tensor of a pipeline or profile (pre-flight refuses named inputs there)."""
    assert isinstance(x, torch.Tensor), "named inputs reached a one-tensor path"
    return x


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``. From the CPU to a GPU the copy goes through pinned memory without
    blocking the host: it is queued on the current stream ahead of the step's kernels, so the
    host gathers the next batch while the device still runs this one (torch's caching host
    allocator keeps the pinned buffer until the copy has run)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def inputs_to(x: Inputs, device: torch.device) -> Inputs:
    """``x`` on ``device`` (`to_device`), a dict of named inputs included (dtypes kept)."""
    if isinstance(x, Mapping):
        return {k: to_device(v, device) for k, v in x.items()}
    return to_device(x, device)


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every predicted position: logits (..., V), targets (...);
    targets of -100 are left out (masked language modelling: `data.masking`)."""
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-100
    )


class BlockModel(nn.Module):
    """``blocks`` run in order; ``user_prefix`` is what export strips (see `export_state`).

    ``layers`` are the module paths (under ``blocks.0``) of a one-block user model's repeated
    layers ([Note: block view] in `models.blocks`); empty for built-ins and ``nn.Sequential``.
    """

    def __init__(
        self,
        blocks: list[nn.Module],
        loss_fn: LossFn = cross_entropy_loss,
        *,
        user_prefix: str = "",
        layers: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*blocks)
        self.loss_fn = loss_fn
        self.user_prefix = user_prefix
        self.layers = list(layers or [])

    def forward(self, x: Inputs) -> Any:
        if isinstance(x, Mapping):  # named inputs are the first block's keyword arguments
            first, *rest = self.blocks
            out = first(**x)
            for block in rest:
                out = block(out)
            return out
        return self.blocks(x)

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target)

    def units(self) -> list[nn.Module]:
        """The modules sharded / recomputed one at a time: the repeated layers, else the blocks."""
        if self.layers:
            return [self.blocks[0].get_submodule(p) for p in self.layers]
        return list(self.blocks)

    def export_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` under the user's own parameter names (a built-in's keys are unchanged)."""
        if not self.user_prefix:
            return state
        n = len(self.user_prefix)
        return {k[n:] if k.startswith(self.user_prefix) else k: v for k, v in state.items()}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

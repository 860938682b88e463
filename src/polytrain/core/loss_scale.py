"""Dynamic loss scaling for ``train.dtype = "fp16"`` (Micikevicius et al., ICLR 2018).

[Note: dynamic loss scaling] float16 keeps 5 exponent bits: small gradients underflow to zero
unless the loss is multiplied by a large factor before backward, and a factor too large makes
some gradient overflow. As torch's ``GradScaler`` does, the factor starts at 2^16, halves after
every step whose gradients overflowed (that step's update is skipped) and doubles after 2000
steps in a row without one. Everything stays on the device: the gradients are unscaled in
place before the step's non-finite flag is taken (`core.step.nonfinite_flag`), so an overflow
shows as that flag, the update is skipped through the same ``found_inf`` path as a NaN, and the
factor is updated from the same reduced flag on every rank (`core.step.finish_step`). An
overflow is part of fp16 training, not an error: it skips the step whatever
``train.on_nonfinite`` says; a non-finite *loss* still follows ``train.on_nonfinite``.
"""

from __future__ import annotations

import torch

from polytrain._torch_private import scale_, update_loss_scale

__all__ = ["LossScale", "backward", "loss_scale_of"]


class LossScale:
    """The scale factor and its growth counter, on the device ([Note: dynamic loss scaling])."""

    def __init__(
        self,
        device: torch.device,
        *,
        init: float = 2.0**16,
        growth: float = 2.0,
        backoff: float = 0.5,
        interval: int = 2000,
    ) -> None:
        self.factor = torch.full((), init, dtype=torch.float32, device=device)
        self._good_steps = torch.zeros((), dtype=torch.int32, device=device)
        self.growth, self.backoff, self.interval = growth, backoff, interval

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the factor: what backward starts from."""
        return loss * self.factor.to(loss.dtype)

    @torch.no_grad()
    def unscale_(self, grads: list[torch.Tensor]) -> None:
        """Divide gradients (plain tensors or local shards) by the factor, in place."""
        scale_(grads, self.factor.reciprocal())

    @torch.no_grad()
    def update(self, overflow: torch.Tensor) -> None:
        """After a step: halve the factor where ``overflow`` (0-d, non-zero: the step's
        gradients overflowed on some rank), else count towards doubling it."""
        update_loss_scale(
            self.factor,
            self._good_steps,
            overflow.to(self.factor.device, torch.float32),
            self.growth,
            self.backoff,
            self.interval,
        )

    def state_dict(self) -> dict[str, float | int]:
        """The factor and counter as numbers (read on the host: for checkpoints only)."""
        return {"factor": float(self.factor), "good_steps": int(self._good_steps)}


def loss_scale_of(dtype: str, device: torch.device) -> LossScale | None:
    """A fresh `LossScale` for ``train.dtype = "fp16"``, None for the other dtypes."""
    return LossScale(device) if dtype == "fp16" else None


def backward(loss: torch.Tensor, scale: LossScale | None) -> None:
    """``loss.backward()``, from the scaled loss under fp16."""
    (loss if scale is None else scale.scaled(loss)).backward()

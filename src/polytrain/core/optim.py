"""Optimizers and the learning-rate schedule (linear warm-up, then cosine to a floor)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from polytrain._lazy_dist import is_dtensor
from polytrain.config.job import OptimConfig

__all__ = ["build_optimizer", "lr_at"]


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: OptimConfig, *, fused: bool | None = None
) -> torch.optim.Optimizer:
    """``cfg``'s optimizer over ``params`` (those that require a gradient).

    ``fused`` (default: ``optim.fused``, true) asks for torch's fused kernel: the whole update
    of every tensor in one pass, on the CPU and on GPUs (AdamW on DTensors too; SGD on plain
    tensors only, for want of a DTensor rule in torch). It is
    the same formula with a different order of float operations (results differ in the last
    bits from torch's default, a per-tensor loop on the CPU and ``foreach`` on a GPU), and it
    takes a ``found_inf`` flag, which keeps the step's NaN/Inf decision on the device ([Note:
    the step stays on the device] in `polytrain.core.step`).

    [Note: fused SGD's first step] torch's fused SGD with momentum creates its momentum buffers
    uninitialised on its first step and leaves them so when ``found_inf`` skips that step, so a
    non-finite first step would poison every later one. The buffers start at zero here instead:
    the first update is then ``0 * momentum + g = g``, exactly what the first step writes.
    """
    params = [p for p in params if p.requires_grad]
    fused = cfg.fused if fused is None else fused
    if cfg.name == "sgd":
        # DTensor has no sharding rule for fused SGD (it has for fused AdamW): torch's default
        # update there, whose non-finite decision is read on the host.
        fused = fused and not any(is_dtensor(p) for p in params)
        sgd = torch.optim.SGD(
            params,
            lr=cfg.lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            fused=fused or None,
        )
        if fused and cfg.momentum:  # [Note: fused SGD's first step]
            for p in params:
                sgd.state[p]["momentum_buffer"] = torch.zeros_like(p)
        return sgd
    return torch.optim.AdamW(
        _apart(params) if fused else params,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        weight_decay=cfg.weight_decay,
        fused=fused or None,
    )


def _apart(params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    """``params`` as one parameter group, or two when DTensors and plain tensors mix (tensor
    parallelism leaves modules outside its plan plain): a fused kernel call takes one kind."""
    dtensors = [p for p in params if is_dtensor(p)]
    plain = [p for p in params if not is_dtensor(p)]
    return [{"params": group} for group in (dtensors, plain) if group] or [{"params": params}]


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate of 0-based ``step``."""
    if cfg.schedule == "constant":
        return cfg.lr
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(total_steps - warmup, 1)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

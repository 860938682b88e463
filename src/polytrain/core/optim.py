"""Optimizers and the learning-rate schedule (linear warm-up, then cosine to a floor)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from polytrain.config.job import OptimConfig

__all__ = ["build_optimizer", "lr_at"]


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: OptimConfig, *, fused: bool = False
) -> torch.optim.Optimizer:
    """``cfg``'s optimizer over ``params`` (those that require a gradient).

    ``fused`` asks for torch's fused kernel: the whole update of every tensor in one pass, the
    same formula with a different order of float operations (results differ in the last bits).
    Only for plain tensors on the CPU or a GPU ([Note: fused server optimizer] in
    `polytrain.ps.server`); the default is torch's own choice (per-tensor loop on the CPU).
    """
    params = [p for p in params if p.requires_grad]
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=cfg.lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            fused=fused or None,
        )
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        weight_decay=cfg.weight_decay,
        fused=fused or None,
    )


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

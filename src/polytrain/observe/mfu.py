"""Model FLOPs utilisation: achieved FLOP/s over the device's peak (PaLM, Chowdhery et al. 2022).

FLOPs per sample are 6 x parameters x tokens (forward + backward of every weight) plus the
attention score term, 12 x layers x width x tokens^2 for a GPT. The peak is known only for the
GPUs in the table; on other devices MFU is not reported rather than guessed.
"""

from __future__ import annotations

import torch
from torch import nn

from polytrain.models.gpt import Block

__all__ = ["flops_per_sample", "peak_flops"]

# Dense bf16 peak FLOP/s from the vendors' data sheets.
_PEAKS = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "L4": 121e12,
    "A10": 125e12,
}


def flops_per_sample(model: nn.Module, tokens: int) -> float:
    n_params = sum(p.numel() for p in model.parameters())
    flops = 6.0 * n_params * tokens
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    if blocks:
        width = blocks[0].ln1.normalized_shape[0]
        flops += 12.0 * len(blocks) * width * tokens * tokens
    return flops


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in _PEAKS.items():
        if key in name:
            return value
    return None

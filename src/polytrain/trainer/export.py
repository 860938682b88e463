"""Final weights as safetensors: written to a temporary name, then renamed (never half-written)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

import polytrain

__all__ = ["save_weights"]


def save_weights(state: dict[str, torch.Tensor], path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        str(tmp),
        metadata={"format": "pt", "polytrain": polytrain.__version__},
    )
    tmp.replace(out)
    return out

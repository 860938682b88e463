"""Final weights as safetensors: written to a temporary name, then linked (never half-written,
never over another file)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

import polytrain
from polytrain.trainer.outputs import publish_new

__all__ = ["save_weights"]


def save_weights(state: dict[str, torch.Tensor], path: str | Path) -> Path:
    """Write ``state`` to ``path``, never replacing an existing file ([Note: output paths])."""

    def write(tmp: Path) -> None:
        save_file(
            {k: v.contiguous() for k, v in state.items()},
            str(tmp),
            metadata={"format": "pt", "polytrain": polytrain.__version__},
        )

    return publish_new(path, write)

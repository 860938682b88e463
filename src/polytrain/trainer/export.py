"""Final weights as safetensors: written to a temporary name, then linked (never half-written,
never over another file).

[Note: tied weights on disk] safetensors refuses tensors that share storage (GPT-2's ``wte`` and
``lm_head``), and its error message is empty. Each later name of a shared tensor is written as a
copy, so ``model.load_state_dict(load_file(path))`` finds every key the model has, and the tie is
recorded in the file's metadata (``tied``: ``"a=b;..."``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import polytrain
from polytrain.trainer.outputs import publish_new

__all__ = ["load_weights", "save_weights"]


def save_weights(state: dict[str, torch.Tensor], path: str | Path) -> Path:
    """Write ``state`` to ``path``, never replacing an existing file ([Note: output paths])."""
    tensors, ties = _untie(state)
    metadata = {"format": "pt", "polytrain": polytrain.__version__}
    if ties:
        metadata["tied"] = ";".join(f"{a}={b}" for a, b in ties)

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp), metadata=metadata)

    return publish_new(path, write)


def _untie(
    state: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], list[tuple[str, str]]]:
    """Contiguous tensors with no shared storage, and (copy, original) name pairs."""
    seen: set[int] = set()  # storages already written
    views: dict[tuple[int, int, tuple[int, ...]], str] = {}
    out: dict[str, torch.Tensor] = {}
    ties: list[tuple[str, str]] = []
    for key, value in state.items():
        value = value.contiguous()
        storage = value.untyped_storage().data_ptr()
        view = (storage, int(value.storage_offset()), tuple(value.shape))
        if value.numel() and storage in seen:
            if view in views:  # the same tensor under a second name: a tie
                ties.append((key, views[view]))
            value = value.clone()
        elif value.numel():
            seen.add(storage)
            views[view] = key
        out[key] = value
    return out, ties


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors only: safetensors cannot carry code."""
    return load_file(str(path))

"""A ``.safetensors`` data set: ``targets`` and one or several named input tensors, dtypes kept.

``inputs`` alone is the model's one positional input; any other names (``input_ids``,
``attention_mask``, ``pixel_values``, ``labels``...) are passed as keyword arguments
(docs/models.md). Integer inputs stay integer (token ids index an embedding); float inputs are
float32. Integer targets are class indices (cross-entropy), float targets values (mse).

Shapes: N rows; every tensor's first dim is N.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from polytrain.errors import ConfigError

__all__ = ["load_tensor_pairs"]


def _kept(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() else t


def load_tensor_pairs(
    path: Path,
) -> tuple[torch.Tensor | dict[str, torch.Tensor], torch.Tensor, int]:
    """``(inputs, targets, rows)`` of a ``.safetensors`` data file (a `ConfigError` if malformed)."""
    tensors = load_file(str(path))
    names = sorted(k for k in tensors if k != "targets")
    if "targets" not in tensors or not names or ("inputs" in names and len(names) > 1):
        raise ConfigError(
            f"data.source = {str(path)!r} has tensors {sorted(tensors)}: expected 'targets' "
            "and either 'inputs' or named inputs (e.g. 'input_ids', 'attention_mask')"
        )
    targets = tensors["targets"]
    rows = len(targets)
    uneven = [k for k in names if tensors[k].dim() == 0 or len(tensors[k]) != rows]
    if uneven:
        raise ConfigError(
            f"data.source = {str(path)!r}: tensor {uneven[0]!r} has shape "
            f"{tuple(tensors[uneven[0]].shape)} but 'targets' has {rows} rows: every tensor "
            "needs the same number of rows"
        )
    if names == ["inputs"]:
        return _kept(tensors["inputs"]), targets, rows
    return {k: _kept(tensors[k]) for k in names}, targets, rows

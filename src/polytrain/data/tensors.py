"""A ``.safetensors`` or ``.npz`` data set (or a JSONL / Parquet / Arrow table, `data.tables`):
``targets`` and one or several named input tensors, dtypes kept.

``inputs`` alone is the model's one positional input; any other names (``input_ids``,
``attention_mask``, ``pixel_values``, ``labels``...) are passed as keyword arguments
(docs/models.md). Integer inputs stay integer (token ids index an embedding); float inputs are
float32. Integer targets are class indices (cross-entropy), float targets values (mse).

A ``.npz`` (numpy's archive of ``.npy`` arrays, ``numpy.savez``) is read with
``allow_pickle=False``: object arrays are refused, never unpickled.

Shapes: N rows; every tensor's first dim is N.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from polytrain.data.tables import TABLE_SUFFIXES, read_table
from polytrain.errors import ConfigError

__all__ = ["MAX_VOCAB", "check_tensor_pairs", "load_numpy_pairs", "load_tensor_pairs"]

# Token ids and class labels index an embedding / output table of this many rows at most.
MAX_VOCAB = 1 << 24


def _kept(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() else t


Pairs = tuple[torch.Tensor | dict[str, torch.Tensor], torch.Tensor, int]


def load_tensor_pairs(path: Path, source: str) -> Pairs:
    """``(inputs, targets, rows)`` of a ``.safetensors`` data file or a JSONL / Parquet / Arrow
    table (`data.tables`), checked row by row (a `ConfigError` naming ``source`` if malformed)."""
    if path.suffix in TABLE_SUFFIXES:
        return check_tensor_pairs(read_table(path, source), source)
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # SafetensorError is not exported under a stable name
        raise ConfigError(
            f"data.source = {source!r} is not a valid .safetensors file "
            f"({str(exc).split('. ')[0][:80]}): write it with safetensors.torch.save_file"
        ) from None
    return check_tensor_pairs(tensors, source)


def load_numpy_pairs(path: Path, source: str) -> Pairs:
    """As `load_tensor_pairs`, from a ``.npz`` archive (``numpy.savez``), never unpickling."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (ValueError, OSError, EOFError) as exc:  # object arrays need pickle: refused here
        raise ConfigError(
            f"data.source = {source!r} is not a readable numeric .npz archive "
            f"({str(exc).split('. ')[0][:80]}): write it with numpy.savez(path, inputs=..., "
            "targets=...)"
        ) from None
    unsupported = [k for k, a in arrays.items() if a.dtype.kind not in "biuf"]
    if unsupported:
        name = unsupported[0]
        raise ConfigError(
            f"data.source = {source!r}: array {name!r} has dtype {arrays[name].dtype}: "
            "expected numbers (bool, integer or float)"
        )
    tensors = {k: torch.from_numpy(np.ascontiguousarray(a)) for k, a in arrays.items()}
    tensors = {k: t.long() if not t.is_floating_point() else t for k, t in tensors.items()}
    return check_tensor_pairs(tensors, source)


def targets_beside(path: Path) -> Path:
    """Where the labels of a ``.npy`` array of inputs live: ``x.npy`` -> ``x.targets.npy``."""
    return path.with_name(path.stem + ".targets.npy")


def load_numpy_array_pairs(path: Path, source: str) -> Pairs:
    """As `load_numpy_pairs`, from a ``.npy`` array of inputs (images: ``(N, C, H, W)``) with
    its targets in the ``.targets.npy`` file beside it (`targets_beside`), never unpickling."""
    arrays = {}
    for name, file in (("inputs", path), ("targets", targets_beside(path))):
        try:
            arrays[name] = np.load(file, allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise ConfigError(
                f"data.source = {source!r}: {file.name} is not a readable numeric .npy array "
                f"({str(exc).split('. ')[0][:80]}): save it with numpy.save"
            ) from None
    bad = [k for k, a in arrays.items() if a.dtype.kind not in "biuf"]
    if bad:
        raise ConfigError(
            f"data.source = {source!r}: the {bad[0]} array has dtype {arrays[bad[0]].dtype}: "
            "expected numbers (bool, integer or float)"
        )
    tensors = {k: torch.from_numpy(np.ascontiguousarray(a)) for k, a in arrays.items()}
    tensors = {k: t.long() if not t.is_floating_point() else t for k, t in tensors.items()}
    return check_tensor_pairs(tensors, source)


def check_tensor_pairs(tensors: dict[str, torch.Tensor], source: str) -> Pairs:
    """``(inputs, targets, rows)`` of named tensors, checked row by row (a `ConfigError`
    naming ``source`` if malformed)."""
    names = sorted(k for k in tensors if k != "targets")
    if "targets" not in tensors or not names or ("inputs" in names and len(names) > 1):
        raise ConfigError(
            f"data.source = {source!r} has tensors {sorted(tensors)}: expected 'targets' "
            "and either 'inputs' or named inputs (e.g. 'input_ids', 'attention_mask')"
        )
    targets = tensors["targets"]
    if targets.dim() == 0:
        raise ConfigError(
            f"data.source = {source!r} has a scalar 'targets': every tensor needs a first "
            "dimension of rows (scalars are not data)"
        )
    rows = len(targets)
    uneven = [k for k in names if tensors[k].dim() == 0 or len(tensors[k]) != rows]
    if uneven:
        raise ConfigError(
            f"data.source = {source!r}: tensor {uneven[0]!r} has shape "
            f"{tuple(tensors[uneven[0]].shape)} but 'targets' has {rows} rows: every tensor "
            "needs the same number of rows (scalars are not data)"
        )
    if rows < 2:
        raise ConfigError(
            f"data.source = {source!r} holds {rows} row(s): need at least 2 (one for "
            "training, one for validation)"
        )
    if not targets.is_floating_point() and targets.numel():
        low, high = int(targets.min()), int(targets.max())
        if low < 0 or high >= MAX_VOCAB:
            bad = low if low < 0 else high
            raise ConfigError(
                f"data.source = {source!r} holds class label {bad}: integer targets are class "
                f"indices in [0, {MAX_VOCAB}); use float targets for regression"
            )
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ConfigError(
                f"data.source = {source!r}: {name} hold NaN or Inf values: clean the data"
            )
    if names == ["inputs"]:
        return _kept(tensors["inputs"]), targets, rows
    return {k: _kept(tensors[k]) for k in names}, targets, rows

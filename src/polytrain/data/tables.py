"""JSON Lines, Parquet and Arrow data sets through Hugging Face ``datasets``, read from local files.

A table is a data set like a ``.safetensors`` one (`data.tensors`): a ``targets`` column and
either an ``inputs`` column or named input columns (``input_ids``, ``attention_mask``...). Each
column becomes one tensor with a first dim of rows; a column of equal-length lists becomes a
(rows, length) tensor. dtypes are kept: integer columns stay int64 (token ids), floating
columns become float32. Text columns and ragged lists are one-line errors (tokenize and pad
first). ``datasets`` is optional (``pip install datasets``); without it these files are a
one-line error naming the install.

[Note: optional import] ``datasets`` takes seconds to import (pandas, pyarrow) and most jobs
never read a table, so it is imported by name (``importlib``) when a table is read, not at the
top of the module.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch

from polytrain.errors import ConfigError

__all__ = ["TABLE_SUFFIXES", "read_table"]

TABLE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")


def _datasets(source: str) -> Any:
    try:
        module = importlib.import_module("datasets")  # [Note: optional import]
    except ImportError:
        raise ConfigError(
            f"data.source = {source!r} is a table read through Hugging Face datasets, which is "
            "not installed: pip install datasets (or convert it to .safetensors)"
        ) from None
    module.disable_progress_bars()
    module.logging.set_verbosity_error()
    return module


def _open(path: Path, source: str) -> Any:
    hf = _datasets(source)
    try:
        if path.suffix == ".parquet":
            return hf.Dataset.from_parquet(str(path), keep_in_memory=True)
        if path.suffix == ".arrow":  # datasets' own Arrow files (Dataset.save_to_disk)
            return hf.Dataset.from_file(str(path), in_memory=True)
        return hf.Dataset.from_json(str(path), keep_in_memory=True)
    except Exception as exc:  # datasets raises many types for a malformed file
        detail = str(exc).splitlines()[0][:100] if str(exc) else type(exc).__name__
        raise ConfigError(
            f"data.source = {source!r} could not be read as {path.suffix[1:]} ({detail}): "
            "check the file, one JSON object per line for .jsonl"
        ) from None


def read_table(path: Path, source: str) -> dict[str, torch.Tensor]:
    """Every column of the table at ``path`` as a tensor (a `ConfigError` naming a bad column)."""
    table = _open(path, source)
    columns = table.with_format("torch")[:]
    out: dict[str, torch.Tensor] = {}
    for name, column in columns.items():
        if isinstance(column, torch.Tensor):
            out[name] = column
            continue
        first = column[0] if len(column) else None
        if isinstance(first, torch.Tensor):
            shapes = sorted({tuple(c.shape) for c in column})
            fix = f"rows of different shapes {shapes[:3]}: pad them to one length"
        else:
            fix = f"{type(first).__name__} values: tokenize text into integer ids first"
        raise ConfigError(f"data.source = {source!r}: column {name!r} holds {fix}")
    return out

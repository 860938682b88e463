"""Metrics as JSON lines, one object per logged step, written by rank 0."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import IO, Any

import torch

__all__ = ["MetricsWriter", "peak_memory_mb"]


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak, or the resident-set high-water mark."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


class MetricsWriter:
    """Append JSON lines to ``path``; a no-op when ``path`` is None (non-zero ranks)."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self._file: IO[str] | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

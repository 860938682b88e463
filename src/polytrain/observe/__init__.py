"""Observability: JSONL metrics, progress bar, Chrome-trace timelines (contract 5)."""

from polytrain.observe.metrics import MetricsWriter, peak_memory_mb
from polytrain.observe.trace import Tracer

__all__ = ["MetricsWriter", "Tracer", "peak_memory_mb"]

"""Chrome-trace timelines: one pid per rank, one complete ("X") event per span.

Each rank writes its own part file; rank 0 merges them after a barrier, so no Python object
crosses the network. Open the result in chrome://tracing or Perfetto, or render it with
``polytrain timeline``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["Tracer", "merge_traces"]


class Tracer:
    """Records spans for one rank; disabled (and free) when ``enabled`` is False."""

    def __init__(self, rank: int, enabled: bool = True) -> None:
        self.rank = rank
        self.enabled = enabled
        self.events: list[dict[str, Any]] = []

    @contextmanager
    def span(self, name: str, cat: str = "compute", **args: Any) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        # Wall-clock microseconds, so spans of ranks on one host line up without a handshake.
        start = time.time()
        try:
            yield
        finally:
            end = time.time()
            self.events.append(
                {
                    "name": name,
                    "cat": cat,
                    "ph": "X",
                    "pid": self.rank,
                    "tid": 0,
                    "ts": start * 1e6,
                    "dur": (end - start) * 1e6,
                    "args": args,
                }
            )

    def write_part(self, path: str | Path) -> Path:
        part = Path(f"{path}.rank{self.rank}")
        part.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "name": "process_name",
            "ph": "M",
            "pid": self.rank,
            "args": {"name": f"rank {self.rank}"},
        }
        part.write_text(json.dumps([meta, *self.events]))
        return part


def merge_traces(prefix: str | Path, world_size: int) -> str:
    """The Chrome trace (JSON text) of the ``prefix.rank*`` part files; the parts are removed.

    The caller writes it where the user asked, never over an existing file."""
    events: list[dict[str, Any]] = []
    for rank in range(world_size):
        part = Path(f"{prefix}.rank{rank}")
        events.extend(json.loads(part.read_text()))
        part.unlink()
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})

"""How far a job has got, read from the files its trainer writes: checkpoints and metrics.

No torch and no trainer import (the trainer package imports torch on import): the executor
reads two plain files. A checkpoint is committed by renaming ``step_<N>.tmp/`` to
``step_<N>/`` after its manifest is written ([Note: checkpoint commit] in
trainer/checkpoint.py, names from trainer/manifest.py), so a ``step_<N>/`` directory holding
``manifest.json`` is a finished save; the trainer itself verifies its checksums when it resumes.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["newest_checkpoint", "seconds_per_step", "steps_logged"]

_PREFIX = "step_"  # trainer/manifest.py's directory prefix
_MANIFEST = "manifest.json"


def newest_checkpoint(root: Path) -> int | None:
    """The step of the newest committed checkpoint under ``root``, None where there is none."""
    if not root.is_dir():
        return None
    steps = [
        int(path.name[len(_PREFIX) :])
        for path in root.iterdir()
        if path.name.startswith(_PREFIX)
        and path.name[len(_PREFIX) :].isdigit()
        and (path / _MANIFEST).is_file()
    ]
    return max(steps, default=None)


def _last_record(run_dir: Path) -> dict[str, object] | None:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    last = None
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line being written now
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            last = record
    return last


def steps_logged(run_dir: Path) -> int | None:
    """The last step a run logged (``metrics.jsonl``), None before its first log line."""
    record = _last_record(run_dir)
    return None if record is None else int(record["step"])  # type: ignore[call-overload]


def seconds_per_step(run_dir: Path) -> float | None:
    """The step time the run logged last (``step_time_s``), None before its first log line."""
    record = _last_record(run_dir)
    value = None if record is None else record.get("step_time_s")
    return float(value) if isinstance(value, int | float) else None

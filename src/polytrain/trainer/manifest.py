"""The checkpoint manifest: what a checkpoint holds, and the checks that make it trustworthy.

A checkpoint is a directory ``step_<9 digits>/`` with one ``rank_<5 digits>.safetensors`` file per
rank and a ``manifest.json`` written last. The manifest lists every file with its size and
sha256, and every tensor with the file that holds it; `verify` recomputes the checksums, so a
truncated or altered file is named and the checkpoint refused. Pure Python: JSON and hashlib.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from polytrain.errors import CheckpointError

__all__ = [
    "FORMAT",
    "MANIFEST",
    "Manifest",
    "committed",
    "latest_valid",
    "sha256_file",
    "step_dir",
    "verify",
]

FORMAT = "polytrain-checkpoint/1"
MANIFEST = "manifest.json"
_PREFIX = "step_"


@dataclass
class Manifest:
    step: int  # optimizer steps completed; the next step to run (0-based) is this number
    layout: dict[str, Any]  # strategy, dp, tp, pp, zero, world_size
    data: dict[str, Any]  # position (= step), seed, global_batch_size, source
    lr_schedule: dict[str, Any]  # schedule, step, total_steps, next lr
    optimizer: dict[str, Any]  # name and rank 0's hyperparameters
    rng: dict[str, Any]  # world_size and the key of each rank's generator state
    versions: dict[str, str]  # torch, polytrain
    job_fingerprint: str
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> sha256, bytes
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> file, dtype, shape
    job: dict[str, Any] = field(default_factory=dict)  # the saving job's config, for comparison
    format: str = FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> Manifest:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{where}: manifest is not valid JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise CheckpointError(f"{where}: manifest format {found!r}, expected {FORMAT!r}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise CheckpointError(f"{where}: manifest fields do not match ({exc})") from None


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"{_PREFIX}{step:09d}"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def committed(root: str | Path) -> list[tuple[int, Path]]:
    """Checkpoint directories under ``root`` (never ``*.tmp``), newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        name = path.name
        if path.is_dir() and name.startswith(_PREFIX) and name[len(_PREFIX) :].isdigit():
            found.append((int(name[len(_PREFIX) :]), path))
    return sorted(found, reverse=True)


def verify(path: Path) -> Manifest:
    """The manifest of checkpoint ``path`` after checking every file; `CheckpointError` if not."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST} (the save never completed)")
    manifest = Manifest.from_json(manifest_path.read_text(), str(manifest_path))
    for name, info in sorted(manifest.files.items()):
        file = path / name
        if Path(name).name != name:
            raise CheckpointError(f"{path}: manifest names {name!r}, outside the checkpoint")
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (listed in the manifest)")
        size = file.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(
                f"{file}: {size} bytes, the manifest says {info['bytes']} (truncated or altered)"
            )
        if sha256_file(file) != info["sha256"]:
            raise CheckpointError(f"{file}: sha256 differs from the manifest (altered)")
    for key, info in manifest.tensors.items():
        if info["file"] not in manifest.files:
            raise CheckpointError(f"{path}: tensor {key!r} is in unlisted file {info['file']!r}")
    return manifest


def latest_valid(root: str | Path) -> tuple[tuple[Path, Manifest] | None, list[str]]:
    """The newest checkpoint that verifies, and one message per newer one that was refused."""
    refused: list[str] = []
    for _, path in committed(root):
        try:
            return (path, verify(path)), refused
        except CheckpointError as exc:
            refused.append(str(exc))
    return None, refused

"""The checkpoint manifest: what a checkpoint holds, and the checks that make it trustworthy.

A checkpoint is a directory ``step_<9 digits>/`` with one ``rank_<5 digits>.safetensors`` file per
rank and a ``manifest.json`` written last. The manifest lists every file with its size and
sha256, and every tensor with the file that holds it; `verify` recomputes the checksums, so a
truncated or altered file is named and the checkpoint refused. Pure Python: JSON and hashlib.

[Note: manifest checks] The manifest carries a sha256 of its own canonical JSON
(``manifest_sha256``), and `read_manifest` checks it and every field's type before any value is
used: ``step`` equals the number in the directory name, ``files`` maps file names to
``{sha256, bytes}``, ``tensors`` maps keys to ``{file, dtype, shape}`` with a listed file, and
`verify` reads each file's safetensors header (JSON, no tensor data) to check that every tensor
the manifest maps to a file is in that file with that shape. An edited manifest (a step changed,
a tensor mapped to another rank's file, ``files`` as a list) is therefore refused like a corrupt
file, and the loader falls back to the previous valid checkpoint instead of crashing. A manifest
without ``manifest_sha256`` (written before the field existed) is checked field by field only.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
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
    "read_manifest",
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
    layout: dict[str, Any]  # strategy, family, dp, tp, pp, zero, sync, world_size
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
    job_identity: str = ""  # which job owns the checkpoint (trainer/ownership.py); "" = unknown
    manifest_sha256: str = (
        ""  # of the canonical JSON of every other field ([Note: manifest checks])
    )

    def to_json(self) -> str:
        data = asdict(self)
        data["manifest_sha256"] = _self_checksum(data)
        return json.dumps(data, indent=1, sort_keys=True)

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
            manifest = cls(**data)
        except TypeError as exc:
            raise CheckpointError(f"{where}: manifest fields do not match ({exc})") from None
        _check_fields(manifest, where)  # first: names the field an edit broke
        if manifest.manifest_sha256 and manifest.manifest_sha256 != _self_checksum(data):
            raise CheckpointError(f"{where}: manifest checksum differs (the manifest was edited)")
        return manifest


def _self_checksum(data: dict[str, Any]) -> str:
    body = {k: v for k, v in data.items() if k != "manifest_sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_fields(m: Manifest, where: str) -> None:
    """`CheckpointError` naming the first field of the wrong type ([Note: manifest checks])."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: manifest field {what}")

    if not _is_int(m.step) or m.step < 0:
        raise bad(f"step = {m.step!r} is not a non-negative integer")
    for name in ("layout", "data", "lr_schedule", "optimizer", "rng", "versions", "job"):
        if not isinstance(getattr(m, name), dict):
            raise bad(f"{name} is a {type(getattr(m, name)).__name__}, not a mapping")
    if not isinstance(m.job_fingerprint, str) or not isinstance(m.job_identity, str):
        raise bad("job_fingerprint / job_identity is not a string")
    if not isinstance(m.files, dict):
        raise bad(f"files is a {type(m.files).__name__}, not a mapping of file names")
    for name, info in m.files.items():
        if not (
            isinstance(info, dict)
            and isinstance(info.get("sha256"), str)
            and _is_int(info.get("bytes"))
        ):
            raise bad(f"files[{name!r}] = {info!r} is not {{sha256, bytes}}")
        if Path(name).name != name or name in ("", ".", ".."):
            raise bad(f"files names {name!r}, outside the checkpoint")
    if not isinstance(m.tensors, dict):
        raise bad(f"tensors is a {type(m.tensors).__name__}, not a mapping of keys")
    for key, info in m.tensors.items():
        if not (
            isinstance(info, dict)
            and isinstance(info.get("file"), str)
            and isinstance(info.get("dtype"), str)
            and isinstance(info.get("shape"), list)
            and all(_is_int(n) and n >= 0 for n in info["shape"])
        ):
            raise bad(f"tensors[{key!r}] = {info!r} is not {{file, dtype, shape}}")
        if info["file"] not in m.files:
            raise bad(f"tensors[{key!r}] is in unlisted file {info['file']!r}")


def _safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (8-byte little-endian length, then JSON)."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than its header)")
        (length,) = struct.unpack("<Q", head)
        if length > path.stat().st_size - 8:
            raise CheckpointError(f"{path}: not a safetensors file (header length {length})")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (header is not a mapping)")
    return header


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


def read_manifest(path: Path) -> Manifest:
    """The manifest of checkpoint ``path``, its own checksum and fields checked, its step equal
    to the directory's; the files are not read (`verify` does that)."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST} (the save never completed)")
    try:
        text = manifest_path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{manifest_path}: unreadable ({exc})") from None
    manifest = Manifest.from_json(text, str(manifest_path))
    name = path.name[len(_PREFIX) :]
    if not name.isdigit() or int(name) != manifest.step:
        raise CheckpointError(
            f"{manifest_path}: manifest step {manifest.step} does not match the directory name "
            f"{path.name!r} (moved or edited)"
        )
    return manifest


def verify(path: Path) -> Manifest:
    """The manifest of checkpoint ``path`` after checking every file; `CheckpointError` if not."""
    manifest = read_manifest(path)
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
    headers = {name: _safetensors_header(path / name) for name in manifest.files}
    for key, info in manifest.tensors.items():
        entry = headers[info["file"]].get(key)
        if not isinstance(entry, dict) or entry.get("shape") != info["shape"]:
            raise CheckpointError(
                f"{path}: the manifest maps tensor {key!r} (shape {info['shape']}) to "
                f"{info['file']}, which does not hold it (edited manifest)"
            )
    return manifest


def latest_valid(
    root: str | Path, owner: Callable[[Manifest], bool] | None = None
) -> tuple[tuple[Path, Manifest] | None, list[str]]:
    """The newest checkpoint that verifies, and one message per newer one that was refused.

    With ``owner``, checkpoints it rejects (another job's, trainer/ownership.py) are skipped
    silently: they are not this job's to load, nor damaged."""
    refused: list[str] = []
    for _, path in committed(root):
        try:
            manifest = verify(path)
        except CheckpointError as exc:
            refused.append(str(exc))
            continue
        if owner is None or owner(manifest):
            return (path, manifest), refused
    return None, refused

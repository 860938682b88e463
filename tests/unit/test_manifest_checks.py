"""Issue 11, case 4: edited manifests are refused, and the loader falls back to the previous
valid checkpoint instead of crashing ([Note: manifest checks] in trainer/manifest.py)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save as safetensors_bytes

from polytrain.errors import CheckpointError
from polytrain.trainer.manifest import MANIFEST, Manifest, latest_valid, step_dir, verify


def two_rank_checkpoint(root: Path, step: int) -> Path:
    """A checkpoint as two ranks write it: rank 0 holds ``model.a``, rank 1 ``model.b``."""
    path = step_dir(root, step)
    path.mkdir(parents=True)
    manifest = Manifest(
        step=step,
        layout={"world_size": 2},
        data={"position": step},
        lr_schedule={},
        optimizer={},
        rng={},
        versions={},
        job_fingerprint="0",
    )
    for rank, (key, shape) in enumerate([("model.a", (2, 3)), ("model.b", (4,))]):
        name = f"rank_{rank:05d}.safetensors"
        blob = safetensors_bytes({key: torch.zeros(shape)})
        (path / name).write_bytes(blob)
        manifest.files[name] = {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
        manifest.tensors[key] = {"file": name, "dtype": "torch.float32", "shape": list(shape)}
    (path / MANIFEST).write_text(manifest.to_json())
    return path


def edit(path: Path, change: Callable[[dict[str, Any]], None], *, reseal: bool) -> None:
    """Change the manifest's JSON; ``reseal``: also recompute its checksum (a careful editor)."""
    data = json.loads((path / MANIFEST).read_text())
    change(data)
    if reseal:
        data = json.loads(Manifest(**data).to_json())
    (path / MANIFEST).write_text(json.dumps(data))


def set_step(d: dict[str, Any]) -> None:
    d["step"] = 7


def swap_shard(d: dict[str, Any]) -> None:
    d["tensors"]["model.a"]["file"] = "rank_00001.safetensors"


def files_as_list(d: dict[str, Any]) -> None:
    d["files"] = list(d["files"])


def shape_as_text(d: dict[str, Any]) -> None:
    d["tensors"]["model.b"]["shape"] = "4"


def lr_changed(d: dict[str, Any]) -> None:
    d["lr_schedule"]["next_lr"] = 1.0


EDITS = {
    "step changed": (set_step, "does not match the directory name"),
    "tensor mapped to the other shard": (swap_shard, "does not hold it"),
    "files as a list": (files_as_list, "files is a list, not a mapping"),
    "shape as text": (shape_as_text, r"is not \{file, dtype, shape\}"),
}


@pytest.mark.parametrize("reseal", [True, False], ids=["resealed", "checksum stale"])
@pytest.mark.parametrize("name", sorted(EDITS))
def test_an_edited_manifest_is_refused_and_the_previous_one_used(
    name: str, reseal: bool, tmp_path: Path
) -> None:
    # Issue 11, case 4: each of these crashed the resume before.
    change, expected = EDITS[name]
    if not reseal:  # the field checks run first; an edit they accept trips the checksum
        expected = f"({expected}|manifest checksum differs)"
    two_rank_checkpoint(tmp_path, 4)
    newest = two_rank_checkpoint(tmp_path, 8)
    edit(newest, change, reseal=reseal)
    with pytest.raises(CheckpointError, match=expected):
        verify(newest)
    found, refused = latest_valid(tmp_path)
    assert found is not None and found[1].step == 4
    assert len(refused) == 1 and re.search(expected, refused[0])


def test_the_manifest_checksum_catches_an_edit_of_any_field(tmp_path: Path) -> None:
    # Issue 11, case 4: a well-typed edit (the next LR) is caught by the manifest's own sha256.
    path = two_rank_checkpoint(tmp_path, 8)
    assert verify(path).manifest_sha256
    edit(path, lr_changed, reseal=False)
    with pytest.raises(CheckpointError, match="manifest checksum differs"):
        verify(path)

"""Checkpoint manifests without processes: checksums, refusal messages, fall-back, fingerprints."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as safetensors_bytes

from polytrain.comm.watchdog import is_comm_failure
from polytrain.config import job_from_dict
from polytrain.errors import CheckpointError
from polytrain.trainer.manifest import MANIFEST, Manifest, committed, latest_valid, step_dir, verify
from polytrain.trainer.resume_checks import job_differences, job_fingerprint

# A real safetensors file: verify reads its header to check the manifest's tensor map.
PAYLOAD = safetensors_bytes({"model.w": torch.ones(1)})


def fake_checkpoint(root: Path, step: int, payload: bytes = PAYLOAD) -> Path:
    path = step_dir(root, step)
    path.mkdir(parents=True)
    (path / "rank_00000.safetensors").write_bytes(payload)
    manifest = Manifest(
        step=step,
        layout={},
        data={"position": step},
        lr_schedule={},
        optimizer={},
        rng={},
        versions={},
        job_fingerprint="0",
        files={
            "rank_00000.safetensors": {
                "sha256": hashlib.sha256(payload).hexdigest(),
                "bytes": len(payload),
            }
        },
        tensors={"model.w": {"file": "rank_00000.safetensors", "dtype": "f32", "shape": [1]}},
    )
    (path / MANIFEST).write_text(manifest.to_json())
    return path


def test_a_complete_checkpoint_verifies(tmp_path: Path) -> None:
    fake_checkpoint(tmp_path, 5)
    assert verify(step_dir(tmp_path, 5)).step == 5


def test_an_altered_byte_is_named(tmp_path: Path) -> None:
    path = fake_checkpoint(tmp_path, 5)
    (path / "rank_00000.safetensors").write_bytes(PAYLOAD[:-1] + b"\x01")  # same size
    with pytest.raises(CheckpointError, match=r"rank_00000.safetensors: sha256 differs"):
        verify(path)


def test_a_truncated_file_is_named(tmp_path: Path) -> None:
    path = fake_checkpoint(tmp_path, 5)
    (path / "rank_00000.safetensors").write_bytes(PAYLOAD[:6])
    with pytest.raises(
        CheckpointError, match=rf"6 bytes, the manifest says {len(PAYLOAD)} \(trunc"
    ):
        verify(path)


def test_without_a_manifest_it_never_completed(tmp_path: Path) -> None:
    path = fake_checkpoint(tmp_path, 5)
    (path / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="the save never completed"):
        verify(path)


def test_a_manifest_cannot_point_outside_its_directory(tmp_path: Path) -> None:
    path = fake_checkpoint(tmp_path, 5)
    text = (path / MANIFEST).read_text().replace('"rank_00000', '"../rank_00000')
    (path / MANIFEST).write_text(text)
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        verify(path)


def test_newest_valid_wins_and_the_refused_are_listed(tmp_path: Path) -> None:
    fake_checkpoint(tmp_path, 4)
    fake_checkpoint(tmp_path, 8)
    bad = fake_checkpoint(tmp_path, 12)
    (bad / "rank_00000.safetensors").write_bytes(b"x")
    (tmp_path / "step_000000016.tmp").mkdir()  # a save in flight (or crashed) is invisible
    assert [s for s, _ in committed(tmp_path)] == [12, 8, 4]
    found, refused = latest_valid(tmp_path)
    assert found is not None and found[1].step == 8
    assert len(refused) == 1 and "step_000000012/rank_00000.safetensors" in refused[0]


def test_no_pickle_in_the_format(tmp_path: Path) -> None:
    path = fake_checkpoint(tmp_path, 1)
    (path / MANIFEST).write_text("\x80\x04K\x01.")  # a pickle is not JSON: refused, not run
    with pytest.raises(CheckpointError, match="not valid JSON"):
        verify(path)


def test_job_fingerprint_ignores_per_node_fields_only() -> None:
    base = job_from_dict({"launch": {"nproc": 2}})
    node1 = job_from_dict(
        {"launch": {"nproc": 2, "nnodes": 2, "node_rank": 1, "rdzv_endpoint": "h:1"}}
    )
    node0 = job_from_dict(
        {"launch": {"nproc": 2, "nnodes": 2, "node_rank": 0, "rdzv_endpoint": "h:1"}}
    )
    assert job_fingerprint(node0, 4) == job_fingerprint(node1, 4)
    assert job_fingerprint(base, 2) != job_fingerprint(node0, 4)
    other = job_from_dict({"launch": {"nproc": 2}, "train": {"steps": 7}})
    assert job_fingerprint(base, 2) != job_fingerprint(other, 2)


def test_job_differences_name_the_changed_fields() -> None:
    saved = {"train": {"steps": 6, "seed": 1}, "parallel": {"dp": 2}}
    now = {"train": {"steps": 8, "seed": 1}, "parallel": {"dp": 1}}
    assert job_differences(saved, now) == ["train.steps = 6 -> 8"]


def test_comm_failures_are_recognised() -> None:
    gloo = "[unbound_buffer.cc:129] Timed out waiting 2000ms for send operation to complete"
    assert is_comm_failure(RuntimeError(gloo))
    assert is_comm_failure(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    assert not is_comm_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_comm_failure(ValueError("timed out"))


def test_module_of_names_a_shard_by_its_model_keys() -> None:
    import torch
    from torch import nn

    from polytrain.core.modules import module_of

    flat = torch.zeros(6)
    params = {
        "blocks.0.fc.weight": nn.Parameter(flat[:4].view(2, 2)),
        "blocks.2.bias": nn.Parameter(flat[4:]),
    }
    module = module_of(params)
    assert list(module.state_dict()) == ["blocks.0.fc.weight", "blocks.2.bias"]
    module.load_state_dict({"blocks.0.fc.weight": torch.ones(2, 2), "blocks.2.bias": torch.ones(2)})
    assert torch.equal(flat, torch.ones(6))  # written in place, into the flat buffer

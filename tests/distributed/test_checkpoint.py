"""Checkpoints: exact resume, resume under another layout, corruption fallback (issue 6).

One uninterrupted run under dp 2 saves checkpoints after steps 3 and 6. "Stopping at step 3" is
that run's step-3 checkpoint with the later one removed; resuming it must reproduce the
uninterrupted run's final weights (same layout: bitwise; another layout: within fp32 round-off
of the single-process run).
"""

from __future__ import annotations

import shutil
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from polytrain.config import JobConfig
from polytrain.testing import assert_state_close, run_job
from polytrain.trainer.manifest import committed, latest_valid, step_dir, verify
from tests.conftest import small_job

pytestmark = pytest.mark.slow

STEPS, SAVED = 6, 3


def run(job: JobConfig) -> dict[str, Any]:
    return run_job(job, timeout_s=120)


def job(
    ckpt: Path | str = "",
    nproc: int = 2,
    resume: bool = False,
    extra: dict[str, Any] | None = None,
    **sections: dict[str, Any],
) -> JobConfig:
    """AdamW with warm-up, cosine decay and clipping: optimizer state and schedule both matter."""
    sections.setdefault("parallel", {})
    extra = extra or {}
    return small_job(
        optim={
            "name": "adamw",
            "lr": 0.01,
            "schedule": "cosine",
            "warmup_steps": 2,
            "grad_clip": 1.0,
        },
        train={"steps": STEPS},
        checkpoint={"dir": str(ckpt), "every": SAVED, "keep": 5, "resume": resume, **extra}
        if ckpt
        else {},
        launch={"nproc": nproc},
        **sections,
    )


@cache
def uninterrupted(root: str) -> dict[str, Any]:
    """The dp 2 run that wrote the checkpoints; ``root`` is a session-wide directory."""
    return run(job(Path(root) / "full"))


@cache
def single_process() -> dict[str, Any]:
    return run(job(nproc=1))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("ckpt"))


def stopped_at_step_3(root: str, name: str) -> Path:
    """A copy of the uninterrupted run's checkpoints as if it had stopped after step 3."""
    uninterrupted(root)
    src, dst = Path(root) / "full", Path(root) / name
    shutil.copytree(src, dst)
    shutil.rmtree(step_dir(dst, STEPS))
    return dst


def test_checkpoint_directory_and_manifest(root: str) -> None:
    full = Path(root) / "full"
    uninterrupted(root)
    assert [s for s, _ in committed(full)] == [6, 3]
    assert not list(full.glob("*.tmp"))
    manifest = verify(step_dir(full, 3))
    assert manifest.step == 3 and manifest.data["position"] == 3
    assert manifest.layout["dp"] == 2 and manifest.layout["world_size"] == 2
    assert sorted(manifest.files) == ["rank_00000.safetensors", "rank_00001.safetensors"]
    assert {"rng.0.cpu", "rng.1.cpu"} <= set(manifest.tensors)
    assert any(k.startswith("optim.") and k.endswith(".exp_avg_sq") for k in manifest.tensors)
    # Each replicated tensor is written once, and the two ranks share the writing.
    files = {info["file"] for k, info in manifest.tensors.items() if k.startswith("model.")}
    assert len(files) == 2
    # Nothing but JSON and safetensors: no pickle anywhere in the directory.
    assert {p.suffix for p in step_dir(full, 3).iterdir()} == {".json", ".safetensors"}


def test_exact_resume_same_layout(root: str) -> None:
    ckpt = stopped_at_step_3(root, "same")
    resumed = run(job(ckpt, resume=True))
    assert resumed["start"] == SAVED
    assert [r["step"] for r in resumed["history"]] == [4, 5, 6]
    full = uninterrupted(root)
    for name, expected in full["state"].items():
        assert torch.equal(resumed["state"][name], expected), f"{name} differs after resume"


ZBV = {"schedule": "zbv", "microbatches": 2}  # two stages per rank, rank 0's not contiguous


@pytest.mark.parametrize(
    ("nproc", "parallel", "pipeline"),
    [
        (1, {}, {}),
        (2, {"zero": 3}, {}),
        (2, {"tp": 2}, {}),
        (2, {"pp": 2}, {}),
        (2, {"pp": 2}, ZBV),
        (4, {"dp": 2, "pp": 2, "zero": 3}, {}),
    ],
    ids=["dp1", "zero3-dp2", "tp2", "pp2", "zbv-pp2", "zero3-dp2-pp2"],
)
def test_resume_under_another_layout(
    root: str, nproc: int, parallel: dict[str, Any], pipeline: dict[str, Any]
) -> None:
    name = "-".join([f"{k}{v}" for k, v in parallel.items()] + list(pipeline.values())[:1])
    ckpt = stopped_at_step_3(root, "layout-" + name)
    resumed = run(job(ckpt, nproc=nproc, parallel=parallel, pipeline=pipeline, resume=True))
    assert resumed["start"] == SAVED
    ref = single_process()
    assert_state_close(resumed["state"], ref["state"], atol=1e-5)
    # The final checkpoint, written under this layout, holds exactly the final weights.
    final = step_dir(ckpt, STEPS)
    manifest = verify(final)
    for name, tensor in resumed["state"].items():
        info = manifest.tensors[f"model.{name}"]
        assert torch.equal(load_file(final / info["file"])[f"model.{name}"], tensor), name
    losses = [r["loss"] for r in resumed["history"]]
    assert losses == pytest.approx([r["loss"] for r in ref["history"][SAVED:]], abs=1e-5)


def test_corrupt_checkpoint_is_refused_and_the_previous_used(root: str) -> None:
    uninterrupted(root)
    ckpt = Path(root) / "corrupt"
    shutil.copytree(Path(root) / "full", ckpt)
    bad = step_dir(ckpt, STEPS) / "rank_00001.safetensors"
    bad.write_bytes(bad.read_bytes()[:-100])  # truncated
    found, refused = latest_valid(ckpt)
    assert found is not None and found[1].step == SAVED
    assert len(refused) == 1 and str(bad) in refused[0] and "truncated" in refused[0]
    resumed = run(job(ckpt, resume=True))
    assert resumed["start"] == SAVED
    full = uninterrupted(root)
    for name, expected in full["state"].items():
        assert torch.equal(resumed["state"][name], expected), name


def test_sharded_save_resumes_under_another_sharding(root: str) -> None:
    """Saved from tensor-parallel shards (DTensor weights and AdamW moments gathered), resumed
    as pipeline stages (each rank reads only its own blocks)."""
    ckpt = Path(root) / "from-tp2"
    run(job(ckpt, parallel={"tp": 2}))
    shutil.rmtree(step_dir(ckpt, STEPS))
    resumed = run(job(ckpt, parallel={"pp": 2}, resume=True))
    assert resumed["start"] == SAVED
    assert_state_close(resumed["state"], single_process()["state"], atol=1e-5)


def test_async_save_writes_the_same_bytes_and_keeps_the_newest(root: str, tmp_path: Path) -> None:
    run(job(tmp_path, extra={"async_save": True, "keep": 1}))
    assert [s for s, _ in committed(tmp_path)] == [STEPS]
    uninterrupted(root)
    for rank in range(2):
        name = f"rank_{rank:05d}.safetensors"
        ours = load_file(step_dir(tmp_path, STEPS) / name)
        sync = load_file(step_dir(Path(root) / "full", STEPS) / name)
        assert sorted(ours) == sorted(sync)
        for key, tensor in sync.items():  # generator states depend on the process's history
            assert key.startswith("rng.") or torch.equal(ours[key], tensor), key

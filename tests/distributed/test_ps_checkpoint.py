"""Parameter-server (sync) checkpoints: exact resume and resume under plain dp (issue 6), and
colocated servers' checkpoints (issue 14).

A sync PS job (1 server, 2 workers) that stops after step 3 (``train.steps = 3``, the final
checkpoint) and is resumed to step 6 must end with the weights of the uninterrupted 6-step run:
the server wrote its shard and AdamW state, and every clock restarted at step 3.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from polytrain.config import JobConfig
from polytrain.testing import assert_state_close, run_job
from polytrain.trainer.manifest import committed, step_dir, verify
from tests.conftest import small_job
from tests.helpers import hf_models

pytestmark = pytest.mark.slow

STEPS, STOP = 6, 3
OPTIM = {"name": "adamw", "lr": 3e-3, "grad_clip": 0.5, "weight_decay": 0.1}


def run(job: JobConfig) -> dict[str, Any]:
    return run_job(job, timeout_s=120)


def ps_job(steps: int, ckpt: Path | None = None, resume: bool = False) -> JobConfig:
    return small_job(
        parallel={"sync": "ps"},
        ps={"servers": 1, "mode": "sync"},
        optim=OPTIM,
        train={"steps": steps},
        checkpoint={"dir": str(ckpt), "resume": resume} if ckpt else {},
        launch={"nproc": 3},
    )


def test_sync_ps_resume_matches_uninterrupted_and_resumes_under_dp(tmp_path: Path) -> None:
    full = run(ps_job(STEPS))

    ckpt = tmp_path / "ps"
    stopped = run(ps_job(STOP, ckpt))
    assert [s for s, _ in committed(ckpt)] == [STOP]
    manifest = verify(ckpt / f"step_{STOP:09d}")
    # The server (rank 2) wrote every weight and its optimizer state; workers only RNG states.
    writers = {info["file"] for k, info in manifest.tensors.items() if not k.startswith("rng.")}
    assert writers == {"rank_00002.safetensors"}
    assert any(k.startswith("optim.") and k.endswith(".exp_avg") for k in manifest.tensors)
    # The saved weights are the server's after 3 updates, i.e. the stopped run's final weights.
    with safe_open(str(ckpt / f"step_{STOP:09d}" / "rank_00002.safetensors"), "pt") as f:
        saved = {k[len("model.") :]: f.get_tensor(k) for k in f.keys() if k.startswith("model.")}
    assert_state_close(saved, stopped["state"], atol=0.0)

    cross = tmp_path / "dp"
    shutil.copytree(ckpt, cross)

    resumed = run(ps_job(STEPS, ckpt, resume=True))
    assert resumed["start"] == STOP
    assert [r["step"] for r in resumed["history"]] == list(range(STOP + 1, STEPS + 1))
    assert_state_close(resumed["state"], full["state"], atol=1e-6)
    losses = [r["loss"] for r in resumed["history"]]
    assert losses == pytest.approx([r["loss"] for r in full["history"]][STOP:], abs=1e-6)

    # The same checkpoint under plain data parallelism (dp 2): same keys, same trajectory.
    dp = small_job(
        optim=OPTIM,
        train={"steps": STEPS},
        checkpoint={"dir": str(cross), "resume": True},
        launch={"nproc": 2},
    )
    under_dp = run(dp)
    assert under_dp["start"] == STOP
    assert_state_close(under_dp["state"], full["state"], atol=1e-5)


def _colocated_job(ckpt: Path, resume: bool, world: int, **sections: dict[str, Any]) -> JobConfig:
    """Sync ps with servers on ranks 0 and 1, a checkpoint every step, ``sections`` on top."""
    base: dict[str, Any] = {
        "parallel": {"sync": "ps"},
        # The last rank pushes late, so the servers' ranks reach a save before their threads
        # can apply the step's update: the save must wait for it. (A checkpoint every step:
        # only the first save meets the world in a collective.)
        "ps": {"servers": 2, "colocate": True, "chunk_kb": 8, "straggler_delay_s": 0.1},
        "optim": OPTIM,
        "train": {"steps": STEPS, "global_batch_size": 12},
        "checkpoint": {"dir": str(ckpt), "every": 1, "keep": STEPS, "resume": resume},
        "launch": {"nproc": world},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return small_job(**base)


@pytest.mark.parametrize("world", [2, 3])
def test_colocated_resume_matches_uninterrupted(tmp_path: Path, world: int) -> None:
    """[Note: colocated checkpoints]: servers on ranks 0 and 1 (world 3: rank 2 only works)
    save their shards and AdamW state from their worker's rank; resuming from the checkpoint
    after step 3 of 6 reproduces the uninterrupted run (to 1e-6 like the dedicated test: a
    server sums the pushes of a clock in their order of arrival)."""

    def job(ckpt: Path, resume: bool) -> JobConfig:
        return _colocated_job(ckpt, resume, world)

    full = run(job(tmp_path / "a", False))
    assert full["strategy"].endswith("-colocated")
    assert sorted(s for s, _ in committed(tmp_path / "a")) == list(range(1, STEPS + 1))
    manifest = verify(tmp_path / "a" / f"step_{STOP:09d}")
    # Every weight written by the rank whose server updates it (its worker's replica lags one
    # update), each of the two servers writing its shard and its optimizer state.
    writers = {info["file"] for k, info in manifest.tensors.items() if k.startswith("model.")}
    assert writers == {"rank_00000.safetensors", "rank_00001.safetensors"}
    moments = {info["file"] for k, info in manifest.tensors.items() if k.endswith(".exp_avg")}
    assert moments == writers

    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for step in range(STOP + 1, STEPS + 1):
        shutil.rmtree(step_dir(tmp_path / "b", step))
    resumed = run(job(tmp_path / "b", True))
    assert resumed["start"] == STOP
    assert [r["step"] for r in resumed["history"]] == list(range(STOP + 1, STEPS + 1))
    assert_state_close(resumed["state"], full["state"], atol=1e-6)
    losses = [r["loss"] for r in resumed["history"]]
    assert losses == pytest.approx([r["loss"] for r in full["history"]][STOP:], abs=1e-6)


def test_colocated_resume_of_a_transformers_gpt2(tmp_path: Path) -> None:
    """The same on a user's model: transformers' GPT-2 (tiny config), whose lm_head is tied to
    its token embedding, so one tensor has two names in the replica a colocated rank saves
    from; resumed after step 3 of 6 it ends where the uninterrupted run does."""
    data = hf_models.write_data("gpt2", tmp_path / "data.safetensors")

    def job(ckpt: Path, resume: bool) -> JobConfig:
        return _colocated_job(
            ckpt,
            resume,
            2,
            model={"name": "tests.helpers.hf_models:make_gpt2"},
            data={"source": str(data)},
            train={"global_batch_size": 8},
        )

    full = run(job(tmp_path / "a", False))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for step in range(STOP + 1, STEPS + 1):
        shutil.rmtree(step_dir(tmp_path / "b", step))
    resumed = run(job(tmp_path / "b", True))
    assert resumed["start"] == STOP
    assert_state_close(resumed["state"], full["state"], atol=1e-6)
    losses = [r["loss"] for r in resumed["history"]]
    assert losses == pytest.approx([r["loss"] for r in full["history"]][STOP:], abs=1e-6)

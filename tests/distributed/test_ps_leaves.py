"""Leaf servers ([Note: leaf servers] in polytrain.ps.leaf): sync parity with the one-process
run, groups synchronous inside and asynchronous towards the root, a killed leaf, resume under
another number of leaves.

Two emulated hosts of two workers (``ps.ranks_per_host = 2``, as the elastic launcher numbers
ranks) and one root server: world 5, leaves on ranks 0 and 2.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from polytrain.ps import check_staleness_trace
from polytrain.testing import assert_state_close, run_job
from tests.conftest import small_job
from tests.helpers.kill_rank import train_and_kill

pytestmark = pytest.mark.slow

GPT: dict[str, Any] = {"name": "gpt", "n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16}
ADAMW_CLIP = {"name": "adamw", "lr": 3e-3, "grad_clip": 0.5, "weight_decay": 0.1}
HOSTS = {"leaves": "host", "ranks_per_host": 2}


def _stats(out_dir: str, name: str) -> dict[str, Any]:
    return json.loads((Path(out_dir) / "ps" / f"{name}.json").read_text())


@pytest.mark.parametrize(
    ("world", "ps"),
    [
        (5, {"servers": 1, **HOSTS}),  # 2 hosts x 2 workers, one leaf per host
        (6, {"servers": 2, "leaves": 2, "chunk_kb": 4}),  # 2 root shards, chunked
    ],
    ids=["host-leaves", "2roots-chunked"],
)
def test_sync_leaves_match_single_process(world: int, ps: dict[str, Any], tmp_path: Path) -> None:
    """GPT, AdamW with global-norm clipping at the root: every parameter within 1e-5."""
    model, optim, train = GPT, ADAMW_CLIP, {"global_batch_size": 8, "steps": 3}
    ref = run_job(small_job(model=model, optim=optim, train=train))
    out_dir = str(tmp_path)
    job = small_job(
        model=model,
        optim=optim,
        train=train,
        parallel={"sync": "ps"},
        ps=ps,
        launch={"nproc": world},
        observe={"out_dir": out_dir},
    )
    out = run_job(job)
    assert out["strategy"].endswith("-2leaves"), out["strategy"]
    assert_state_close(out["state"], ref["state"], atol=1e-5)
    assert out["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    # The root meets the two leaves only: one push per leaf per step.
    root = _stats(out_dir, "server0")
    assert root["updates"] == 3 and root["pushes"] == 2 * 3
    assert {e[0] for e in root["events"]} == {0, 2}
    for i, leader in enumerate([0, 2]):
        leaf = _stats(out_dir, f"leaf{i}")
        assert {e[0] for e in leaf["events"]} == {leader, leader + 1}
        assert leaf["pushes"] == 2 * 3


def test_groups_run_ahead_of_the_root_within_the_ssp_bound(tmp_path: Path) -> None:
    """ps.mode = 'ssp' (bound 2) at the root, sync inside each group; the last worker
    straggles, so the other group runs ahead: its workers see staleness above 0 and at most
    2, recorded by its leaf as SSP records it; the root's own trace holds the bound."""
    out_dir = str(tmp_path)
    steps = 12
    job = small_job(
        parallel={"sync": "ps"},
        ps={"servers": 1, **HOSTS, "mode": "ssp", "staleness": 2, "straggler_delay_s": 0.15},
        launch={"nproc": 5},
        train={"steps": steps, "global_batch_size": 8},
        observe={"out_dir": out_dir},
    )
    out = run_job(job)
    assert out["strategy"] == "ps-ssp-1s4w-2leaves"
    root = _stats(out_dir, "server0")
    assert check_staleness_trace([tuple(e) for e in root["events"]], 2) == []
    assert root["updates"] == 2 * steps  # one update per leaf push
    fast, slow = _stats(out_dir, "leaf0"), _stats(out_dir, "leaf1")
    for leaf in (fast, slow):
        assert check_staleness_trace([tuple(e) for e in leaf["events"]], 2) == []
        assert leaf["pushes"] == 2 * steps  # both workers of the group, every step
    # Group 0 runs ahead of the straggler's group and sees it: staleness 1..2.
    assert max(fast["max_staleness_by_worker"].values()) >= 1
    seen = [r["ps_staleness"] for r in out["history"] if "ps_staleness" in r]
    assert seen and max(seen) <= 2


def test_checkpoint_holds_the_root_and_resumes_under_another_number_of_leaves(
    tmp_path: Path,
) -> None:
    """Stopped after step 3 with two leaves (one per worker), resumed to step 6 with one leaf
    of both workers: the weights of the uninterrupted one-process run. Only the root server
    (rank 2) wrote weights; leaves hold nothing of their own."""
    from polytrain.trainer.manifest import committed, verify

    steps, stop, ckpt = 6, 3, tmp_path / "ckpt"

    def job(steps: int, leaves: int, resume: bool = False) -> Any:
        return small_job(
            parallel={"sync": "ps"},
            ps={"servers": 1, "leaves": leaves},
            optim=ADAMW_CLIP,
            train={"steps": steps, "global_batch_size": 8},
            checkpoint={"dir": str(ckpt), "resume": resume},
            launch={"nproc": 3},
        )

    ref = run_job(small_job(optim=ADAMW_CLIP, train={"steps": steps, "global_batch_size": 8}))
    run_job(job(stop, leaves=1))
    assert [s for s, _ in committed(ckpt)] == [stop]
    manifest = verify(ckpt / f"step_{stop:09d}")
    writers = {i["file"] for k, i in manifest.tensors.items() if not k.startswith("rng.")}
    assert writers == {"rank_00002.safetensors"}
    resumed = run_job(job(steps, leaves=2, resume=True))
    assert resumed["start"] == stop and resumed["strategy"].endswith("-1leaves")
    assert_state_close(resumed["state"], ref["state"], atol=1e-5)
    assert resumed["losses"] == pytest.approx(ref["losses"][stop:], abs=1e-5)


def test_async_group_rehomes_to_the_root_when_its_leaf_dies(tmp_path: Path) -> None:
    """[Note: re-homed groups]: async, groups [0, 1] and [2, 3], root rank 4. SIGKILL rank 2
    (leaf1 and a worker) mid-run: rank 3 joins the root and the run finishes; the root dropped
    the dead leaf and kept what it had applied."""
    out_dir, steps, world, victim = str(tmp_path / "run"), 150, 5, 2
    job = small_job(
        parallel={"sync": "ps"},
        ps={"servers": 1, "leaves": 2, "mode": "async"},
        launch={"nproc": world},
        train={"steps": steps, "eval_batches": 2, "global_batch_size": 8},
        observe={"out_dir": out_dir, "log_every": 1},
    )
    out, code = train_and_kill(job, world, victim, tmp_path, after_steps=20)
    assert code == -signal.SIGKILL
    assert out[0]["steps"] == steps and out[3]["steps"] == steps
    root = _stats(out_dir, "server0")
    removed = {w: (clock, why) for w, clock, why in root["removed"]}
    assert victim in removed and 0 < removed[victim][0] < steps, removed
    joined = dict(root["joined"])
    assert joined.get(3, 0) > 0, root["joined"]  # re-homed mid-run at the root's clock
    left = dict(root["left"])
    assert left[1] == -1 and left[3] > 0 and 0 in left  # rank 1 never needed the root
    assert {w for w, _, _ in root["events"]} == {0, 2, 3}  # leaf0, leaf1 before, then rank 3

"""Leaf servers ([Note: leaf servers] in polytrain.ps.leaf): sync parity with the one-process
run, groups synchronous inside and asynchronous towards the root, a killed leaf, resume under
another number of leaves.

Two emulated hosts of two workers (``ps.ranks_per_host = 2``, as the elastic launcher numbers
ranks) and one root server: world 5, leaves on ranks 0 and 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from polytrain.testing import assert_state_close, run_job
from tests.conftest import small_job

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

"""Gossip and local SGD: parity with data parallel where it must hold, and what differs where not."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest

from polytrain.testing import RankFailure, assert_state_close, max_abs_diff, run_job
from tests.conftest import small_job
from tests.helpers.resume import resumed_after_step_3

pytestmark = pytest.mark.slow

# Plain SGD (no momentum): the mean of the replicas' updates is data parallel's update.
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.0}


@cache
def reference() -> dict[str, Any]:
    """Data parallel on one rank (contract 1: the same as any world size)."""
    return run_job(small_job(optim=SGD))


@pytest.mark.parametrize("world", [2, 4])
def test_localsgd_period_one_matches_data_parallel(world: int) -> None:
    out = run_job(
        small_job(
            optim=SGD,
            parallel={"sync": "localsgd"},
            localsgd={"period": 1},
            launch={"nproc": world},
        )
    )
    assert out["strategy"] == f"localsgd-h1-w{world}"
    assert_state_close(out["state"], reference()["state"], atol=1e-5)
    assert out["losses"] == pytest.approx(reference()["losses"], abs=1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_gossip_on_a_complete_graph_matches_data_parallel(world: int) -> None:
    out = run_job(
        small_job(
            optim=SGD,
            parallel={"sync": "gossip"},
            gossip={"topology": "complete"},
            launch={"nproc": world},
        )
    )
    assert_state_close(out["state"], reference()["state"], atol=1e-5)
    # A complete graph leaves no disagreement after each round.
    dist = [r["consensus_distance"] for r in out["history"] if "consensus_distance" in r]
    assert dist and max(dist) < 1e-5
    # Every worker pushes (world - 1) full fp32 copies per step.
    n_params = sum(t.numel() for t in out["state"].values())
    assert out["history"][0]["bytes_sent"] == (world - 1) * n_params * 4


def test_ring_gossip_disagrees_but_stays_close_and_exports_the_average() -> None:
    job = small_job(
        optim=SGD,
        train={"steps": 6},
        parallel={"sync": "gossip"},
        gossip={"topology": "ring"},
        observe={"log_every": 1, "progress": False},
        launch={"nproc": 4},
    )
    out = run_job(job)
    ref = run_job(small_job(optim=SGD, train={"steps": 6}))
    dist = [r["consensus_distance"] for r in out["history"]]
    assert all(d > 1e-7 for d in dist)  # replicas really differ on a ring of 4
    # The exported average is not data parallel's model, but close to it after 6 steps.
    gap = max_abs_diff(out["state"], ref["state"])
    assert 1e-6 < gap < 0.05
    # Ring: 2 neighbours, each gets a third of the replica.
    n_params = sum(t.numel() for t in out["state"].values())
    assert out["history"][0]["bytes_sent"] == 2 * n_params * 4


def test_random_peers_push_sum_and_fp16_wire() -> None:
    out = run_job(
        small_job(
            optim=SGD,
            parallel={"sync": "gossip"},
            gossip={"topology": "random", "peers": 1, "compress": "fp16"},
            observe={"log_every": 1, "progress": False},
            launch={"nproc": 4},
        )
    )
    hist = out["history"]
    n_params = sum(t.numel() for t in out["state"].values())
    # One peer, fp16, the push-sum weight appended: (n + 1) * 2 bytes, every round.
    assert all(r["bytes_sent"] == (n_params + 1) * 2 for r in hist)
    # Uneven in-degrees move the weights off 1 (push-sum is doing its work) ...
    assert any(abs(r["push_sum_weight"] - 1.0) > 1e-3 for r in hist)
    # ... and the de-biased average model still trains like data parallel's.
    assert max_abs_diff(out["state"], reference()["state"]) < 0.2
    assert hist[-1]["loss"] == pytest.approx(reference()["losses"][-1], rel=0.01)


def test_localsgd_period_two_differs_from_data_parallel_between_averages() -> None:
    out = run_job(
        small_job(
            optim=SGD,
            parallel={"sync": "localsgd"},
            localsgd={"period": 2},
            observe={"log_every": 1, "progress": False},
            launch={"nproc": 2},
        )
    )
    hist = out["history"]
    n_bytes = sum(t.numel() for t in out["state"].values()) * 4
    assert [r["bytes_sent"] for r in hist] == [0, n_bytes, 0, n_bytes]
    assert hist[0]["consensus_distance"] > 1e-7  # after a local step
    assert hist[1]["consensus_distance"] < 1e-6  # after the average
    assert max_abs_diff(out["state"], reference()["state"]) > 1e-6


def test_hierarchical_localsgd_and_diloco_run() -> None:
    out = run_job(
        small_job(
            parallel={"sync": "localsgd"},
            localsgd={"period": 2, "hierarchical": True, "ranks_per_host": 2},
            observe={"log_every": 1, "progress": False},
            launch={"nproc": 4},
        )
    )
    assert out["strategy"] == "localsgd-h2-w4-host2"
    hist = out["history"]
    assert all(r["bytes_sent"] > 0 for r in hist)  # inside a host every step
    assert hist[1]["consensus_distance"] < 1e-6 < hist[0]["consensus_distance"]
    diloco = run_job(
        small_job(
            parallel={"sync": "localsgd"},
            localsgd={"period": 2, "outer": "nesterov"},
            launch={"nproc": 2},
        )
    )
    assert diloco["strategy"] == "localsgd-h2-w2-diloco"
    plain = run_job(
        small_job(parallel={"sync": "localsgd"}, localsgd={"period": 2}, launch={"nproc": 2})
    )
    assert max_abs_diff(diloco["state"], plain["state"]) > 1e-6  # the outer step acted


def test_checkpoint_holds_the_average_and_resume_continues_exactly(tmp_path: Path) -> None:
    """Saved after step 3 of 6 (the average, [Note: the average model]); resuming from it
    reproduces the uninterrupted run bitwise, and the saved weights are one model."""

    full, resumed = resumed_after_step_3(
        tmp_path, parallel={"sync": "gossip"}, gossip={"topology": "ring"}, launch={"nproc": 4}
    )
    assert resumed["start"] == 3
    # Had the checkpoint held one rank's replica (or a mix of replicas' keys), the resumed
    # replicas would start from other values than the uninterrupted run's and drift apart.
    assert_state_close(resumed["state"], full["state"], atol=0.0)


@pytest.mark.parametrize(
    ("sync", "compress"),
    [("gossip", "sign"), ("gossip", "topk"), ("localsgd", "sign"), ("localsgd", "topk")],
)
def test_compressed_messages_with_error_feedback(sync: str, compress: str) -> None:
    """Top-k and 1-bit sign on the wire: the bytes handed to c10d are the packet's, and the
    average model still trains like data parallel ([Note: CHOCO gossip], [Note: compressed
    averaging])."""
    out = run_job(
        small_job(
            optim=SGD,
            parallel={"sync": sync},
            gossip={"compress": compress, "topk_ratio": 0.1},
            localsgd={"period": 2},
            observe={"log_every": 1, "progress": False},
            launch={"nproc": 2},
        )
    )
    hist = out["history"]
    sizes = [t.numel() for t in out["state"].values()]
    n = sum(sizes)
    packet = -(-n // 8) + 4 * len(sizes) if compress == "sign" else -(-n // 10) * (4 + 4)
    sent = [r["bytes_sent"] for r in hist]
    # gossip: one neighbour every step; localsgd: the world average after steps 2 and 4.
    assert sent == ([packet] * 4 if sync == "gossip" else [0, packet, 0, packet])
    # Against an fp32 copy: top-k 10% (value + index) is 5x smaller, sign about 32x.
    assert packet < n * 4 / (4 if compress == "topk" else 25)
    if sync == "localsgd":  # every replica becomes the same decoded average
        assert hist[1]["consensus_distance"] < 1e-6 < hist[0]["consensus_distance"]
    assert max_abs_diff(out["state"], reference()["state"]) < 0.2
    assert hist[-1]["loss"] == pytest.approx(reference()["losses"][-1], rel=0.01)


def test_diloco_checkpoint_holds_anchor_and_outer_momentum(tmp_path: Path) -> None:
    """DiLoCo saved after step 3 of 6 (between the outer steps after steps 2 and 4): resuming
    reproduces the uninterrupted run bitwise only if the anchor and the outer momentum were
    saved and restored ([Note: DiLoCo state]): a fresh anchor (the initial model) and zero
    momentum would make the outer step after step 4 another one."""

    full, resumed = resumed_after_step_3(
        tmp_path,
        parallel={"sync": "localsgd"},
        localsgd={"period": 2, "outer": "nesterov"},
        launch={"nproc": 2},
    )
    assert full["strategy"] == "localsgd-h2-w2-diloco"
    assert resumed["start"] == 3
    assert_state_close(resumed["state"], full["state"], atol=0.0)
    assert resumed["losses"] == full["losses"][3:]


def test_diloco_state_is_not_dropped_on_resume(tmp_path: Path) -> None:
    """A checkpoint of DiLoCo resumed without its outer step would drop the anchor and the
    outer momentum: refused, in one line naming the setting to use (as is the reverse, which
    would start them afresh: `trainer.resume_checks.check_state_carries_over`)."""
    saved, resumed = "nesterov", "none"

    def job(outer: str, steps: int, resume: bool) -> Any:
        checkpoint = {"dir": str(tmp_path), "every": 2, "keep": 5, "resume": resume}
        return small_job(
            train={"steps": steps},
            checkpoint=checkpoint,
            parallel={"sync": "localsgd"},
            localsgd={"period": 2, "outer": outer},
            launch={"nproc": 2},
        )

    run_job(job(saved, 2, False))
    with pytest.raises(
        RankFailure, match=f"localsgd.outer = '{saved}'.*--set localsgd.outer={saved}"
    ):
        run_job(job(resumed, 3, True))

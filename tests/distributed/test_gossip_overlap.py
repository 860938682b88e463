"""Overlapped gossip ([Note: overlapped gossip]) against a one-process simulation of its rule.

The simulation below is written from the update rule in docs/decentralized.md, not from the
strategy's code: two replicas, each its own model and SGD, the mixing matrix of two nodes
(every topology on two nodes is ``M = [[1/2, 1/2], [1/2, 1/2]]``), push-sum weights with the
local update added to the numerator, and the neighbour's message mixed in one step late (all
of it at the last step). The distributed run
must match it parameter by parameter and loss by loss, and must not match the same simulation
without the delay (so the test fails if the overlap mixes the wrong round).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from polytrain.config import JobConfig
from polytrain.core.optim import build_optimizer
from polytrain.data.datasets import build_datasets
from polytrain.data.sampler import Batches
from polytrain.models.base import inputs_to
from polytrain.models.registry import block_size_of, build_model
from polytrain.testing import assert_state_close, max_abs_diff, run_job
from tests.conftest import small_job
from tests.helpers.resume import resumed_after_step_3

pytestmark = pytest.mark.slow

WORLD = 2
M = [[0.5, 0.5], [0.5, 0.5]]


def simulate(job: JobConfig, *, delayed: bool) -> dict[str, Any]:
    """The job's gossip on ``WORLD`` replicas in this process; the average model, the mean loss
    of each step and replica 0's push-sum weight after each step."""
    train_set, val_set, spec = build_datasets(job.data, block_size_of(job.model))
    batches = Batches(train_set, val_set, job.train.global_batch_size, job.train.seed)
    models = [build_model(job.model, spec, job.train.seed) for _ in range(WORLD)]
    opts = [build_optimizer(list(m.parameters()), job.optim) for m in models]
    w = [1.0] * WORLD
    in_flight: list[tuple[torch.Tensor, float]] | None = None
    losses, weights = [], []
    steps = job.train.steps
    for t in range(steps):
        step_losses, before = [], []
        for i, (model, opt) in enumerate(zip(models, opts, strict=True)):
            before.append(parameters_to_vector(model.parameters()).detach().clone())
            opt.zero_grad(set_to_none=True)
            x, y = batches.train(t, i, WORLD, 0, 1)
            loss = model.loss(model(inputs_to(x, torch.device("cpu"))), y)
            loss.backward()
            opt.step()
            step_losses.append(float(loss.detach()))
        losses.append(sum(step_losses) / WORLD)
        with torch.no_grad():
            # The local update d moves the numerator: y = w z_before + d.
            y_ = [
                w[i] * before[i] + (parameters_to_vector(m.parameters()) - before[i])
                for i, m in enumerate(models)
            ]
            kept = [(M[i][i] * y_[i], M[i][i] * w[i]) for i in range(WORLD)]
            sent = [
                (
                    sum(M[i][j] * y_[j] for j in range(WORLD) if j != i),
                    sum(M[i][j] * w[j] for j in range(WORLD) if j != i),
                )
                for i in range(WORLD)
            ]
            arrive: list[list[tuple[Any, float]]] = [[] for _ in range(WORLD)]
            if delayed:
                for i in range(WORLD):
                    if in_flight is not None:
                        arrive[i].append(in_flight[i])
                    if t == steps - 1:  # the last step waits for its own round too
                        arrive[i].append(sent[i])
                in_flight = sent  # type: ignore[assignment]
            else:
                arrive = [[s] for s in sent]
            for i, model in enumerate(models):
                num, weight = kept[i]
                for m_y, m_w in arrive[i]:
                    num, weight = num + m_y, weight + m_w
                w[i] = float(weight)
                vector_to_parameters(num / w[i], model.parameters())
        weights.append(w[0])
    with torch.no_grad():
        total = sum(w[i] * parameters_to_vector(m.parameters()) for i, m in enumerate(models))
        vector_to_parameters(total / sum(w), models[0].parameters())
    state = {k: v.detach().clone() for k, v in models[0].state_dict().items()}
    return {"state": state, "losses": losses, "weights": weights}


def test_overlapped_gossip_equals_the_simulated_one_step_late_mix() -> None:
    job = small_job(
        optim={"name": "sgd", "lr": 0.1, "momentum": 0.9},
        train={"steps": 5},
        parallel={"sync": "gossip"},
        gossip={"topology": "ring", "overlap": True},
        observe={"log_every": 1, "progress": False},
        launch={"nproc": WORLD},
    )
    out = run_job(job)
    assert out["strategy"] == "gossip-ring-w2-overlap"
    want = simulate(job, delayed=True)
    assert_state_close(out["state"], want["state"], atol=1e-5)
    assert out["losses"] == pytest.approx(want["losses"], abs=1e-5)
    hist = out["history"]
    assert [r["push_sum_weight"] for r in hist] == pytest.approx(want["weights"], abs=1e-6)
    assert want["weights"][:2] == pytest.approx([0.5, 0.75])  # mass in flight, then back
    # One message to the one neighbour a step, the weight appended: (n + 1) fp32 values.
    n = sum(t.numel() for t in out["state"].values())
    assert [r["bytes_sent"] for r in hist] == [(n + 1) * 4] * 5
    # The same rule without the delay is another trajectory, far outside the tolerance.
    blocking = simulate(job, delayed=False)
    assert max_abs_diff(blocking["state"], want["state"]) > 1e-4  # 10x the tolerance (6e-4)


def test_overlapped_checkpoint_settles_the_round_in_flight(tmp_path: Path) -> None:
    """Saved after step 3 of 6 with a round in flight: `settle` adds it before the average is
    saved, in the uninterrupted and the resumed run alike, so resuming reproduces the
    uninterrupted run bitwise."""

    full, resumed = resumed_after_step_3(
        tmp_path,
        parallel={"sync": "gossip"},
        gossip={"topology": "ring", "overlap": True},
        launch={"nproc": WORLD},
    )
    assert resumed["start"] == 3
    assert_state_close(resumed["state"], full["state"], atol=0.0)

"""Shared fixtures: small jobs that run in seconds on 2 cores."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

from polytrain.config import JobConfig, job_from_dict
from polytrain.testing import scaled
from tests.helpers.devices import see_gpus


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """pytest-timeout's per-test limit is seconds on an idle machine, stretched by the measured
    slowdown like every other deadline ([Note: deadlines scale with machine speed])."""
    given = config.getoption("timeout", None)  # --timeout on the command line wins, as given
    if given is not None:
        return
    limit = float(config.getini("timeout") or 0)
    if limit <= 0:
        return
    stretched = pytest.mark.timeout(scaled(limit))
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(stretched)


@pytest.fixture(autouse=True)
def _jobs_resolve_as_on_a_cpu_host(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job built in a test takes ``train.device = "auto"`` and ``launch.nproc = "auto"`` as on
    a machine without GPUs (cpu, 2 processes), so the suite means the same on a GPU host;
    tests/gpu sees the real devices, and a test may call `see_gpus` for others."""
    if "gpu" not in request.path.parts:
        see_gpus(monkeypatch, 0)


@pytest.fixture(autouse=True)
def _no_process_group_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that makes a default process group in the pytest process destroys it (the
    trainer's in-process `train()` makes a one-rank gloo group and leaves it for `shutdown()`):
    a group left behind makes a later test's `init_process_group` fail far from its cause, so
    the leaking test fails here instead, and the group is destroyed for the tests after it."""
    yield
    dist = sys.modules.get("torch.distributed")  # not imported yet: no group can exist
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    dist.destroy_process_group()
    pytest.fail(
        f"{request.node.nodeid} left torch.distributed's default process group initialized; "
        "destroy it in the test (try/finally: polytrain.comm.shutdown())",
        pytrace=False,
    )


def small_job(**sections: dict[str, Any]) -> JobConfig:
    """A job small enough for a multi-process test: few steps, small batch, no output."""
    data: dict[str, Any] = {
        "model": {"name": "mlp", "size": "tiny"},
        "train": {
            "steps": 4,
            "global_batch_size": 16,
            "seed": 1,
            "eval_every": 0,
            "eval_batches": 1,
            "sample_tokens": 0,
        },
        "optim": {
            "name": "sgd",
            "lr": 0.05,
            "momentum": 0.9,
            "schedule": "constant",
            "warmup_steps": 0,
            "grad_clip": 0.0,
        },
        "observe": {"progress": False},
        "launch": {"nproc": 1},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return job_from_dict(data)


@pytest.fixture
def job_factory() -> Any:
    return small_job


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread for the test, as every worker runs (restored afterwards)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)

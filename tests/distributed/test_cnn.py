"""The image models reproduce the single-process run parameter by parameter (contract 1) under
data parallel, ZeRO-3, GPipe, (cnn) tensor parallel and hybrid parallelism, and spatial
parallelism at 2 and 4, BatchNorm included (resnet: global statistics through
`core.batchnorm.GlobalBatchNorm`); validation accuracy agrees too.

Jobs of one world size share one set of processes, the references another (spawning dominates
the cost of these tiny jobs). The data is a small random .npz of 8 x 8 images, so the workers need
no scikit-learn.
"""

from __future__ import annotations

import os
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from polytrain.config import JobConfig
from polytrain.testing import assert_state_close, run_distributed
from tests.conftest import small_job

pytestmark = pytest.mark.slow

STRATEGIES: dict[str, dict[str, Any]] = {
    "dp2": {"parallel": {"dp": 2}},
    "zero3-dp2": {"parallel": {"dp": 2, "zero": 3}},
    "gpipe-pp2": {"parallel": {"pp": 2}, "pipeline": {"schedule": "gpipe", "microbatches": 2}},
    "tp2": {"parallel": {"tp": 2}},
    "spatial2": {"parallel": {"dp": 2, "spatial": 2}},
    "spatial4": {"parallel": {"dp": 4, "spatial": 4}, "launch": {"nproc": 4}},
    "hybrid-auto-dp2": {"parallel": {"dp": 2, "hybrid": ["auto"]}},
    # explicit rows (the classifier split too, gathered), two micro-steps, active clipping
    "hybrid-rows-dp2-accum2-clip": {
        "parallel": {
            "dp": 2,
            "hybrid": ["blocks.3.fc=colwise", "blocks.4.fc=rowwise", "blocks.5.out=colwise_gather"],
        },
        "train": {"grad_accum": 2},
        "optim": {"grad_clip": 0.05},
    },
}
# BatchNorm under a micro-batched pipeline cannot match one process (pre-flight refuses it),
# so resnet's pipeline runs one micro-batch; tensor parallel splits cnn's wide Linear layers
# (resnet has one, the classifier).
CASES = [
    ("cnn", "dp2"),
    ("cnn", "zero3-dp2"),
    ("cnn", "gpipe-pp2"),
    ("cnn", "tp2"),
    ("cnn", "hybrid-auto-dp2"),
    ("cnn", "hybrid-rows-dp2-accum2-clip"),
    ("resnet", "dp2"),
    ("resnet", "zero3-dp2"),
    ("resnet", "gpipe-pp2"),
    ("cnn", "spatial2"),
    ("resnet", "spatial2"),
]
# World 4 (one more set of processes) only with POLYTRAIN_FULL_MATRIX=1: bands of 2 rows, 1 row
# after pooling, so every halo is a neighbour's whole band.
if os.environ.get("POLYTRAIN_FULL_MATRIX") == "1":
    CASES += [("cnn", "spatial4"), ("resnet", "spatial4")]
MODELS: dict[str, dict[str, Any]] = {
    "cnn": {"name": "cnn", "n_embd": 64},
    "resnet": {"name": "resnet", "n_layer": 2},
}


@cache
def data_file() -> str:
    """64 random 1 x 8 x 8 images in 10 classes, written once per test session."""
    path = Path(tempfile.mkdtemp(prefix="polytrain-cnn-")) / "images.npz"
    rng = np.random.default_rng(0)
    images = rng.random((64, 1, 8, 8), dtype=np.float32)
    np.savez(path, inputs=images, targets=rng.integers(0, 10, 64))
    return str(path)


def job(model: str, strategy: str | None) -> JobConfig:
    sections: dict[str, dict[str, Any]] = {
        "model": MODELS[model],
        "data": {"source": data_file(), "val_fraction": 0.25},
        "train": {"steps": 3, "eval_batches": 2},
    }
    if strategy is not None:
        sections["launch"] = {"nproc": 2}
        for section, values in STRATEGIES[strategy].items():
            sections.setdefault(section, {}).update(values)
    if model == "resnet" and strategy == "gpipe-pp2":
        sections["pipeline"]["microbatches"] = 1
    return small_job(**sections)


# (kernel, stride, padding, image height) of convolutions checked band by band at world 2:
# two-row halos, strides with unequal halos (2 above, 1 below), an even kernel, no halo at all
# (2x2 stride 2), a negative bottom halo (1x1 stride 2: the band's last row is unused), and a
# band thinner than the kernel (the whole band is a neighbour's halo).
GEOMETRIES = [(5, 1, 2, 16), (5, 2, 2, 16), (4, 2, 1, 16), (2, 2, 0, 8), (1, 2, 0, 8), (3, 1, 1, 4)]


def _band_conv_diffs(rank: int) -> list[float]:
    """Max abs difference, per geometry, of a `BandConv2d` on this rank's band against the
    whole convolution: output rows, input gradient rows, weight gradient summed over bands."""
    import copy

    import torch
    import torch.distributed as dist

    from polytrain.comm.init import new_group
    from polytrain.parallel.spatial import _halo_conv

    group = new_group([0, 1])
    diffs = []
    for k, s, p, h in GEOMETRIES:
        torch.manual_seed(k * 100 + s * 10 + p)
        conv = torch.nn.Conv2d(2, 3, k, stride=s, padding=(p, 1))
        x = torch.randn(2, 2, h, 7, requires_grad=True)
        y = conv(x)
        probe = torch.randn_like(y)
        (y * probe).sum().backward()
        band = copy.deepcopy(conv)
        band.weight.grad = None
        _halo_conv(band, group)
        rows, out_rows = h // 2, y.size(2) // 2
        xb = x.detach()[:, :, rank * rows : (rank + 1) * rows].clone().requires_grad_()
        yb = band(xb)
        own = slice(rank * out_rows, (rank + 1) * out_rows)
        (yb * probe[:, :, own]).sum().backward()
        assert band.weight.grad is not None and x.grad is not None
        weight_grad = band.weight.grad.clone()
        dist.all_reduce(weight_grad, group=group)
        diffs.append(
            max(
                float((yb - y[:, :, own]).abs().max()),
                float((xb.grad - x.grad[:, :, rank * rows : (rank + 1) * rows]).abs().max()),
                float((weight_grad - conv.weight.grad).abs().max()),
            )
        )
    return diffs


def _train_jobs(rank: int, world_size: int, jobs: list[JobConfig]) -> list[dict[str, Any]] | None:
    from polytrain.trainer.loop import train

    results = []
    for one in jobs:
        result = train(one)
        last = result.history[-1]
        results.append(
            {
                "state": result.state_dict,
                "losses": [r["loss"] for r in result.history],
                "accuracy": last.get("val_accuracy"),
                "strategy": result.strategy,
            }
        )
    if world_size == 2 and jobs[0].world_size == 2 and len(jobs) > 2:  # the world-2 outcomes
        diffs = _band_conv_diffs(rank)
        results.append({"band_conv_diffs": max(diffs, default=0.0), "per_geometry": diffs})
    return results if rank == 0 else None


def run_jobs(jobs: list[JobConfig]) -> list[dict[str, Any]]:
    out = run_distributed(_train_jobs, jobs[0].world_size, jobs, timeout_s=240.0)[0]
    assert out is not None
    return out


@cache
def references() -> dict[str, dict[str, Any]]:
    jobs = {m: job(m, None) for m in MODELS}
    jobs["cnn-clip"] = small_job(
        model=MODELS["cnn"],
        data={"source": data_file(), "val_fraction": 0.25},
        train={"steps": 3, "eval_batches": 2},
        optim={"grad_clip": 0.05},
    )
    return dict(zip(jobs, run_jobs(list(jobs.values())), strict=True))


@cache
def outcomes(world: int) -> dict[Any, dict[str, Any]]:
    cases: list[Any] = [c for c in CASES if job(*c).world_size == world]
    if world == 2:
        cases.append("band-conv")  # the halo geometry check runs in the same processes
    return dict(
        zip(
            cases, run_jobs([job(m, s) for m, s in cases[: len(cases) - (world == 2)]]), strict=True
        )
    )


def test_band_convolutions_match_whole_convolutions() -> None:
    """Borders, strides, padding and halos exact: each rank's `BandConv2d` gives its rows of
    the whole convolution's output and input gradient, and the band weight gradients sum to
    the whole one."""
    out = outcomes(2)["band-conv"]
    assert len(out["per_geometry"]) == len(GEOMETRIES)
    # values of order 10 (sums of 50-100 products of unit normals): 1e-4 is float32 rounding;
    # a missing or misplaced halo row is off by order 1
    assert out["band_conv_diffs"] < 1e-4, out["per_geometry"]


@pytest.mark.parametrize(("model", "strategy"), CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_matches_single_process(model: str, strategy: str) -> None:
    ref = references()[model + ("-clip" if "clip" in strategy else "")]
    out = outcomes(job(model, strategy).world_size)[(model, strategy)]
    assert_state_close(out["state"], ref["state"], atol=1e-5)
    assert out["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    if strategy.startswith("spatial"):  # every convolution block runs on a band of rows
        assert out["strategy"] == f"{strategy}-conv3"
    if strategy.startswith("hybrid"):  # auto splits the two wide layers, not the classifier
        assert out["strategy"] == ("hybrid-dp2-mp2" if "auto" in strategy else "hybrid-dp2-mp3")
    # SPMD and pipeline evaluation report top-1 accuracy
    assert ref["accuracy"] is not None and 0.0 <= ref["accuracy"] <= 1.0
    assert out["accuracy"] == pytest.approx(ref["accuracy"], abs=1e-6)
    if model == "resnet":  # BatchNorm's running statistics are compared too (buffers)
        assert any(k.endswith("running_var") for k in ref["state"])

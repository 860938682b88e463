"""MFU's inputs are the planner's: its FLOP count for built-in and factory models alike, and the
hardware catalog's dense peak for the device and the job's dtype (measure/mfu.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from polytrain.comm.init import shutdown
from polytrain.config import JobConfig
from polytrain.data.datasets import build_datasets
from polytrain.measure import mfu
from polytrain.measure.stats import model_stats, train_flops_per_sample
from polytrain.models.registry import block_size_of
from polytrain.planner.catalog import dense_peak, device
from polytrain.planner.types import BACKWARD_FLOPS_PER_FORWARD, BlockStats, ModelStats
from polytrain.trainer.loop import train
from tests.helpers.hf_models import T, write_data


def _flops(job: JobConfig) -> float | None:
    train_set, _, spec = build_datasets(job.data, block_size_of(job.model))
    return train_flops_per_sample(job, spec, train_set)


def test_transformers_gpt2_counted_as_the_planner_counts_it(
    job_factory: Any, tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    # Named-input data (input_ids, targets), the usual way to feed a transformers model: the old
    # count took such a sample as 1 token and knew no attention but models.gpt's.
    data = write_data("gpt2", tmp_path / "gpt2.safetensors")
    n_layer, n_embd = 2, 64
    job = job_factory(
        model={
            "name": "tests.helpers.hf_models:make_gpt2",
            "args": {"n_layer": n_layer, "n_embd": n_embd},
        },
        data={"source": str(data)},
    )
    flops = _flops(job)
    assert flops is not None
    planner = model_stats(job, imports=False)
    assert flops == pytest.approx(planner.train_flops, rel=1e-9)
    params = planner.params  # the tied head counted once, as torch counts it
    # forward + backward: 6 x params x tokens for the matmuls, 12 x layers x width x T^2 for
    # attention's two products (Narayanan et al. SC21, eq. 3)
    expected = (1 + BACKWARD_FLOPS_PER_FORWARD) * 2 * params * T + 12 * n_layer * n_embd * T * T
    assert flops == pytest.approx(expected, rel=0.03)


def test_our_gpt_counted_as_the_planner_counts_it(job_factory: Any) -> None:
    job = job_factory(model={"name": "gpt", "size": "tiny"})
    flops = _flops(job)
    assert flops is not None
    assert flops == pytest.approx(model_stats(job, imports=False).train_flops, rel=1e-9)


def test_attention_counted_in_full_whichever_device_counted_it() -> None:
    # meta counts attention's products inside fwd_flops; a CPU's fused kernel leaves them out
    cpu = BlockStats("blocks.0", 0, 0, 60.0, 0.0, 0.0, attention=((8, 8, 4, 40.0),))
    meta = replace(cpu, fwd_flops=100.0, attention_counted=40.0)
    for block in (meta, cpu):
        assert ModelStats("m", (block,)).train_flops == (1 + BACKWARD_FLOPS_PER_FORWARD) * 100.0


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("NVIDIA H200", "H200"),
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ],
)
def test_peak_is_the_catalogs_dense_figure(
    monkeypatch: pytest.MonkeyPatch, name: str, key: str
) -> None:
    assert dense_peak(name, "bf16") == device(key).peak_flops["bf16"]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _=None: name)
    gpu = torch.device("cuda", 0)
    assert mfu.peak_flops(gpu, "bf16") == device(key).peak_flops["bf16"]
    # fp32 jobs: the fp32 peak while float32 matmuls are exact (torch's default), TF32 once
    # torch is allowed to use it
    assert mfu.peak_flops(gpu, "fp32") == device(key).peak_flops["fp32"]
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert mfu.peak_flops(gpu, "fp32") == device(key).peak_flops["tf32"]


def test_no_peak_on_a_cpu_or_an_unknown_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert mfu.peak_flops(torch.device("cpu"), "bf16") is None
    for name in ("NVIDIA GeForce RTX 4090", "NVIDIA L40S"):  # L40S: not the catalog's L4
        assert dense_peak(name, "bf16") is None
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda _=None, name=name: name)
        assert mfu.peak_flops(torch.device("cuda", 0), "bf16") is None


def test_metrics_record_mfu_from_the_planners_count_and_the_catalogs_peak(
    monkeypatch: pytest.MonkeyPatch, job_factory: Any, one_thread: None
) -> None:
    # the run stays on the CPU; its device reads as an H200 where MFU looks up the peak
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _=None: "NVIDIA H200")
    on_cpu = mfu.peak_flops
    monkeypatch.setattr(mfu, "peak_flops", lambda _, dtype: on_cpu(torch.device("cuda"), dtype))
    job = job_factory(model={"name": "gpt", "size": "tiny"}, train={"steps": 2})
    try:
        result = train(job)
    finally:
        shutdown()
    flops = _flops(job)
    assert flops is not None
    peak = device("H200").peak_flops["fp32"]
    for record in result.history:
        batch = job.train.global_batch_size
        assert record["mfu"] == pytest.approx(flops * batch / record["step_time_s"] / peak)

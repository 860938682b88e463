"""On a CUDA device: training, the planner's statistics and its calibration plan.

CI has no GPU: every test here skips cleanly without one. Run them on a GPU host with
``python -m pytest tests/gpu``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from polytrain.config.job import JobConfig, ModelConfig
from polytrain.measure.calibrate import CalibrationPlan
from polytrain.measure.stats import model_stats
from tests.helpers.cli_runs import ENV

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _losses(tmp_path: Path, device: str, *extra: str) -> list[float]:
    out = tmp_path / f"{device}{'-recompute' if extra else ''}"
    cmd = [sys.executable, "-m", "polytrain.cli.app", "train", "--steps", "4", "--nproc", "1"]
    cmd.append("--no-progress")
    for key, value in {
        "train.device": f'"{device}"',
        "observe.out_dir": f'"{out}"',
        "observe.log_every": "1",
        "train.eval_every": "0",
        "train.sample_tokens": "0",
    }.items():
        cmd += ["--set", f"{key}={value}"]
    proc = subprocess.run(
        [*cmd, *extra], env=ENV, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if line and "loss" in json.loads(line)]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("--set", "parallel.recompute=true")])
def test_one_gpu_run_follows_the_cpu_run(tmp_path: Path, extra: tuple[str, ...]) -> None:
    """The default job on one GPU (one rank) takes the one-rank CPU run's steps (fp32; kernels differ, so a
    tolerance), with and without recomputation."""
    cpu = _losses(tmp_path, "cpu", *extra)
    gpu = _losses(tmp_path, "cuda", *extra)
    assert len(gpu) == len(cpu) == 4
    assert gpu == pytest.approx(cpu, rel=1e-3)


def test_bf16_statistics_split_autocast_weight_copies_on_the_gpu() -> None:
    """[Note: counted under autocast] on CUDA: a bf16 job saves fewer bytes per sample than
    fp32 and a fixed bf16 copy of its Linear weights per pass."""
    job = JobConfig(model=ModelConfig(size="small"))
    fp32 = model_stats(job, device="cuda")
    bf16 = model_stats(replace(job, train=replace(job.train, dtype="bf16")), device="cuda")
    block = bf16.blocks[1]
    assert block.saved_bytes < 0.8 * fp32.blocks[1].saved_bytes
    linear_weights = sum(fi * fo for fi, fo in block.linears)
    assert block.saved_fixed_bytes == pytest.approx(2 * linear_weights, rel=0.1)


def test_a_gpu_host_calibrates_with_the_accelerator_plan() -> None:
    assert CalibrationPlan.for_this_host() == CalibrationPlan.accelerator()

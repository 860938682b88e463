"""End to end through the ``polytrain`` command: parity of layouts, user models, failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from polytrain.testing import max_abs_diff, scaled

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def polytrain(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    # This checkout's code (not whatever polytrain is installed), and tests.helpers importable.
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, "-m", "polytrain.cli.app", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(timeout),
    )


# The MLP job every layout below must reproduce, in one process (one run serves both tests).
MLP_JOB = ["--model", "mlp", "--steps", "20", "--seed", "1", "--optimizer", "sgd", "--no-progress"]


def train_mlp(tmp_path: Path, name: str, *layout: str) -> dict[str, torch.Tensor]:
    """MLP_JOB under ``layout``: its final weights; its metrics end with step 20 and val_loss."""
    out = tmp_path / f"{name}.safetensors"
    proc = polytrain(
        "train",
        *MLP_JOB,
        *layout,
        "--save-final",
        str(out),
        "--out-dir",
        str(tmp_path / name),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    metrics = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
    assert metrics[-1]["step"] == 20 and "val_loss" in metrics[-1]
    return load_file(str(out))


@pytest.fixture(scope="module")
def single_mlp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    return train_mlp(tmp_path_factory.mktemp("single"), "single", "--nproc", "1")


def test_mlp_layouts_agree_to_fp32_roundoff(
    tmp_path: Path, single_mlp: dict[str, torch.Tensor]
) -> None:
    """The issue's acceptance check: nproc 1, dp 2 and dp 2 + ZeRO-3 give the same weights."""
    dp2 = train_mlp(tmp_path, "dp2", "--nproc", "2", "--dp", "2")
    zero3 = train_mlp(tmp_path, "zero3", "--nproc", "2", "--dp", "2", "--zero", "3")
    assert set(dp2) == set(single_mlp)
    assert max_abs_diff(dp2, single_mlp) <= 1e-5
    assert max_abs_diff(zero3, single_mlp) <= 1e-5


def test_gpt_run_prints_sample_and_metrics_path(tmp_path: Path) -> None:
    proc = polytrain(
        "train",
        "--steps",
        "8",
        "--eval-every",
        "4",
        "--set",
        "model.n_layer=1",
        "--no-progress",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "sample:" in proc.stdout and "metrics: runs/" in proc.stdout
    run_dir = next((tmp_path / "runs").iterdir())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert {"step", "loss", "lr", "tokens_per_s", "step_time_s", "memory_mb", "strategy"} <= set(
        records[-1]
    )
    assert (run_dir / "job.toml").is_file()


def test_user_factory_model_trains(tmp_path: Path) -> None:
    proc = polytrain(
        "train",
        "--model",
        "tests.helpers.models:sequential",
        "--steps",
        "5",
        "--set",
        "model.block_size=8",
        "--no-progress",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "final loss" in proc.stdout


def test_failed_worker_is_one_line_naming_the_rank(tmp_path: Path) -> None:
    proc = polytrain(
        "train",
        "--model",
        "tests.helpers.models:exploding",
        "--steps",
        "3",
        "--no-progress",
        cwd=tmp_path,
    )
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.strip().splitlines() if line]
    assert len(lines) == 1, proc.stderr
    assert (
        "worker rank" in lines[0] and "RuntimeError: the user model cannot run forward" in lines[0]
    )


def test_two_nodes_on_loopback(tmp_path: Path, single_mlp: dict[str, torch.Tensor]) -> None:
    """--nnodes/--node-rank/--rdzv-endpoint mean what they mean for torchrun."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = [
        "train",
        *MLP_JOB,
        "--nnodes",
        "2",
        "--nproc",
        "1",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--save-final",
        "two_nodes.safetensors",
    ]
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}  # this checkout's code
    # Whichever node's worker becomes global rank 0 writes the weights.
    node0 = subprocess.Popen(
        [sys.executable, "-m", "polytrain.cli.app", *common, "--node-rank", "0", "--out-dir", "n0"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        node1 = polytrain(*common, "--node-rank", "1", "--out-dir", "n1", cwd=tmp_path)
        _, err0 = node0.communicate(timeout=scaled(120))
    finally:
        node0.kill()
    assert node1.returncode == 0 and node0.returncode == 0, err0 + node1.stderr
    assert (tmp_path / "n0" / "metrics.jsonl").exists() != (
        tmp_path / "n1" / "metrics.jsonl"
    ).exists()
    two = load_file(str(tmp_path / "two_nodes.safetensors"))
    assert max_abs_diff(two, single_mlp) <= 1e-5

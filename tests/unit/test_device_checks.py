"""Devices before any worker starts: ``train.device`` and ``launch.nproc`` resolve on this
machine (GPUs with NCCL where there are any, 2 CPU workers elsewhere), and a device the machine
lacks is one line, exit 2. No GPU here: torch.cuda's answers are monkeypatched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tomllib
import torch

from polytrain.cli.train import _devices
from polytrain.config import JobConfig, job_from_dict
from tests.helpers.cli import assert_usage_error, run_main
from tests.helpers.devices import see_gpus


def _train(tmp_path: Path, *args: str) -> list[str]:
    return ["train", "--steps", "1", "--out-dir", str(tmp_path / "run"), *args]


def test_cuda_without_a_cuda_device_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    see_gpus(monkeypatch, 0)
    code, _, err = run_main(_train(tmp_path, "--set", "train.device='cuda'"), capsys)
    assert_usage_error(code, err, "train.device = 'cuda' but torch sees no CUDA device")
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_more_ranks_than_gpus_is_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    device: str,
) -> None:
    """Two ranks on a one-GPU node would both take GPU 0, which NCCL refuses mid-start; gloo
    ranks may share it."""
    see_gpus(monkeypatch, 1)
    args = _train(tmp_path, "--nproc", "2", "--set", f"train.device='{device}'")
    code, _, err = run_main(args, capsys)
    assert_usage_error(code, err, "launch.nproc = 2 ranks with train.device")
    assert "use --nproc 1" in err
    shared = _dry_run(capsys, "--nproc", "2", "--device", device, "--set", "launch.backend='gloo'")
    assert shared["launch"]["nproc"] == 2


def _dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    """The resolved job ``polytrain train --dry-run ARGS`` prints."""
    code, out, err = run_main(["train", "--dry-run", *args], capsys)
    assert code == 0, err
    return tomllib.loads(out)


def test_nproc_gpu_without_a_gpu_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    see_gpus(monkeypatch, 0)
    code, _, err = run_main(_train(tmp_path, "--nproc", "gpu"), capsys)
    assert_usage_error(code, err, "launch.nproc = 'gpu' but torch sees no GPU here")
    assert "--nproc 2" in err
    assert not (tmp_path / "run").exists()


def test_a_word_other_than_gpu_or_auto_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_main(_train(tmp_path, "--nproc", "all"), capsys)
    assert_usage_error(code, err, "launch.nproc = 'all' has the wrong type")


def test_the_default_job_takes_every_gpu_with_nccl(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    see_gpus(monkeypatch, 4)
    job = _dry_run(capsys)
    assert job["train"]["device"] == "cuda"
    assert job["launch"]["nproc"] == 4 and job["parallel"]["dp"] == 4
    assert job["launch"]["backend"] == "auto"  # nccl on cuda, where the group starts


@pytest.mark.parametrize(
    ("gpus", "args", "device", "nproc"),
    [
        (0, (), "cpu", 2),  # the default job without a GPU: 2 CPU workers, as always
        (0, ("--nproc", "3", "--batch-size", "30"), "cpu", 3),
        (0, ("--device", "auto"), "cpu", 2),
        (4, ("--device", "cpu"), "cpu", 2),  # an explicit CPU stays on the CPU
        (4, ("--device", "cpu", "--nproc", "gpu"), "cpu", 4),  # one CPU process per GPU
        (4, ("--nproc", "2"), "cuda", 2),
        (4, ("--set", "launch.nproc='gpu'"), "cuda", 4),
    ],
)
def test_flags_and_the_machine_choose(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    gpus: int,
    args: tuple[str, ...],
    device: str,
    nproc: int,
) -> None:
    see_gpus(monkeypatch, gpus)
    job = _dry_run(capsys, *args)
    assert (job["train"]["device"], job["launch"]["nproc"]) == (device, nproc)


def test_the_start_line_names_devices_and_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    see_gpus(monkeypatch, 0)
    assert _devices(JobConfig()) == "2 CPU processes, gloo"
    assert _devices(job_from_dict({"launch": {"nproc": 1}})) == "1 CPU process, gloo"
    see_gpus(monkeypatch, 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    assert _devices(JobConfig()) == "2 x cuda (NVIDIA H200), nccl"
    gloo = job_from_dict({"launch": {"backend": "gloo"}})
    assert _devices(gloo) == "2 x cuda (NVIDIA H200), gloo"

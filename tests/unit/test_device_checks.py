"""`train.device = "cuda"` is checked before any worker starts: one line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.cli import assert_usage_error, run_main


def _train(tmp_path: Path, *args: str) -> list[str]:
    return ["train", "--steps", "1", "--out-dir", str(tmp_path / "run"), *args]


def test_cuda_without_a_cuda_device_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
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
    """Two ranks on a one-GPU node would both take GPU 0, which NCCL refuses mid-start."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = _train(tmp_path, "--nproc", "2", "--set", f"train.device='{device}'")
    code, _, err = run_main(args, capsys)
    assert_usage_error(code, err, "launch.nproc = 2 ranks with train.device")
    assert "use --nproc 1" in err

"""Every malformed invocation is one line on stderr naming the problem, and exit code 2."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests.helpers.cli import assert_usage_error, run_main

CASES = {
    "unknown flag": (["--stepz", "3"], "No such option: --stepz"),
    "unknown key": (["--set", "train.stepz=3"], "unknown key 'train.stepz'"),
    "unknown section": (["--set", "trian.steps=3"], "unknown key 'trian'"),
    "wrong type flag": (["--steps", "ten"], "Invalid value for '--steps'"),
    "wrong type key": (["--set", "optim.lr=fast"], "optim.lr = 'fast' has the wrong type"),
    "mesh != nproc": (["--nproc", "2", "--dp", "2", "--tp", "2"], "does not equal the 2"),
    "tp does not divide": (["--nproc", "3", "--tp", "2"], "does not divide the 3"),
    "batch not divisible": (["--nproc", "2", "--batch-size", "31"], "not divisible by"),
    "micro-batches": (
        ["--nproc", "2", "--microbatches", "3", "--batch-size", "32"],
        "not divisible by",
    ),
    "negative lr": (["--lr", "-0.1"], "optim.lr = -0.1"),
    "zero steps": (["--steps", "0"], "train.steps = 0"),
    "unknown optimizer": (["--optimizer", "lamb"], "optim.name = 'lamb'"),
    "zero 1": (["--zero", "1"], "parallel.zero = 1 is not offered"),
    "missing data": (["--data", "/no/such/file.txt"], "does not exist"),
    "unknown model": (["--model", "alexnet"], "not a built-in model"),
    "image model on text": (["--model", "cnn"], "needs images"),
    "hybrid plan naming no module": (
        ["--model", "cnn", "--data", "digits", "--set", "parallel.hybrid=['blocks.9.fc=colwise']"],
        "hybrid plan row 'blocks.9.fc=colwise': pattern 'blocks.9.fc' matches no module",
    ),
    "hybrid plan on a convolution": (
        [
            "--model",
            "cnn",
            "--data",
            "digits",
            "--set",
            "parallel.hybrid=['blocks.0.conv=colwise']",
        ],
        "'blocks.0.conv' is not an nn.Linear",
    ),
    "spatial split taller than the image": (
        ["--model", "cnn", "--data", "digits", "--nproc", "16", "--set", "parallel.spatial=16"],
        "parallel.spatial = 16 is larger than the image height 8",
    ),
    "spatial bands below a stride": (
        ["--model", "cnn", "--data", "digits", "--nproc", "8", "--set", "parallel.spatial=8"],
        "'blocks.0.pool' (kernel 2, stride 2, padding 0) reads 8 rows",
    ),
    "spatial not over every rank": (
        ["--model", "cnn", "--data", "digits", "--nproc", "4", "--set", "parallel.spatial=2"],
        "parallel.spatial = 2 must equal the data-parallel degree 4",
    ),
    "hybrid with zero": (
        ["--model", "cnn", "--data", "digits", "--zero", "3", "--set", "parallel.hybrid=['auto']"],
        "works with plain data parallel only, but parallel.zero = 3",
    ),
    "unimportable factory": (["--model", "no_such_pkg.models:make"], "cannot import module"),
    "missing factory": (["--model", "math:no_such"], "has no callable"),
    "heads vs width": (["--set", "model.n_head=3"], "not divisible by model.n_head"),
    "more stages than blocks": (
        ["--model", "mlp", "--nproc", "8", "--pp", "8", "--batch-size", "8"],
        "only 4 blocks",
    ),
    "resume without dir": (["--resume"], "needs checkpoint.dir"),
    "nnodes without endpoint": (["--nnodes", "2"], "--rdzv-endpoint"),
    "endpoint without a port": (
        ["--rdzv-endpoint", "127.0.0.1:notaport"],
        "launch.rdzv_endpoint = '127.0.0.1:notaport': expected HOST:PORT",
    ),
    "bad dtype": (["--dtype", "fp8"], "train.dtype = 'fp8'"),
    "negative timeout": (["--timeout", "-1"], "launch.timeout_s = -1"),
    "negative staleness": (["--staleness", "-2"], "ps.staleness = -2"),
    "leaves not dividing the workers": (
        ["--sync", "ps", "--nproc", "5", "--ps-leaves", "3", "--batch-size", "8"],
        "ps.leaves = 3 does not divide the 4 workers",
    ),
    "leaves without parameter servers": (
        ["--nproc", "4", "--ps-leaves", "host"],
        "ps.leaves = 'host' with parallel.sync = 'allreduce'",
    ),
    "bad partition": (["--partition", "first"], "--partition 'first'"),
    "missing config": (["--config", "/no/such.toml"], "does not exist"),
}


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code, _, err = run_full(args, capsys)
    return code, err


def run_full(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    return run_main(["train", "--dry-run", *args], capsys)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_invocation(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    args, expected = CASES[name]
    code, err = run(args, capsys)
    assert_usage_error(code, err, expected)


def test_invalid_toml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "job.toml"
    bad.write_text("[train\nsteps = 3")
    code, err = run(["--config", str(bad)], capsys)
    assert code == 2 and "is not valid TOML" in err


def test_existing_output_is_never_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "weights.safetensors"
    save_file({"w": torch.ones(2)}, str(target))
    before = target.read_bytes()
    code, err = run(["--save-final", str(target)], capsys)
    assert code == 2 and "already exists" in err
    assert target.read_bytes() == before


def test_valid_dry_run_prints_the_resolved_job(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_full(["--nproc", "4", "--tp", "2", "--model", "mlp"], capsys)
    assert code == 0
    assert "dp = 2" in out and "tp = 2" in out


def _images(tmp_path: Path, shape: tuple[int, ...]) -> str:
    path = tmp_path / "images.npz"
    np.savez(path, inputs=np.zeros(shape, dtype=np.float32), targets=np.arange(shape[0]) % 2)
    return str(path)


@pytest.mark.parametrize(
    ("model", "shape", "expected"),
    [
        ("cnn", (4, 16, 16, 3), "look channels-last (H, W, C) with 3 channel(s)"),
        ("tests.helpers.contract_models:rgb_cnn", (4, 1, 8, 8), "with 1 channel(s), but the "),
    ],
    ids=["channels-last", "grey-for-rgb-model"],
)
def test_images_with_the_wrong_channels(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    model: str,
    shape: tuple[int, ...],
    expected: str,
) -> None:
    code, err = run(["--model", model, "--data", _images(tmp_path, shape)], capsys)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and expected in err, err

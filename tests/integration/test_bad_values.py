"""Issue 11, case 9: odd data files and numbers are one line naming the value, exit 2, in
pre-flight (``--dry-run`` runs the same pre-flight as a real run, before any worker starts)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from polytrain.cli.app import main
from polytrain.config import job_from_dict
from polytrain.errors import ConfigError

NUMBERS = {
    "batch 1e11": (["--batch-size", "100000000000"], "train.global_batch_size = 100000000000"),
    "n_embd 1e10": (["--model", "mlp", "--set", "model.n_embd=10000000000"], "model.n_embd"),
    "seed 2^70": (["--seed", str(2**70)], f"train.seed = {2**70}"),
    "lr inf": (["--lr", "inf"], "optim.lr = inf"),
    "lr 1e300": (["--lr", "1e300"], "optim.lr = 1e+300"),
    "timeout inf": (["--timeout", "inf"], "launch.timeout_s = inf"),
    "timeout 1e300": (["--timeout", "1e300"], "launch.timeout_s = 1e+300"),
    "bucket inf": (["--bucket-mb", "inf"], "parallel.bucket_mb = inf"),
    "bucket 1e300": (["--bucket-mb", "1e300"], "parallel.bucket_mb = 1e+300"),
    "worker timeout inf": (["--set", "ps.worker_timeout_s=inf"], "ps.worker_timeout_s = inf"),
    "grad clip inf": (["--set", "optim.grad_clip=inf"], "optim.grad_clip = inf"),
}


def _write(path: Path, what: Callable[[Path], None]) -> Path:
    what(path)
    return path


DATA: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "object npy": (
        "obj.npy",
        lambda p: np.save(p, np.array([1, "a", None], dtype=object), allow_pickle=True),
        "not a readable numeric .npy array",
    ),
    "text named npy": ("t.npy", lambda p: p.write_text("hello\n" * 50), "not a readable"),
    "garbage safetensors": (
        "g.safetensors",
        lambda p: p.write_bytes(b"\x00\x01garbage" * 100),
        "not a valid .safetensors file",
    ),
    "scalar tensors": (
        "s.safetensors",
        lambda p: save_file({"inputs": torch.tensor(1.0), "targets": torch.tensor(1)}, str(p)),
        "scalars are not data",
    ),
    "negative token ids": ("n.npy", lambda p: np.save(p, np.array([0, 1, 2, -3] * 50)), "-3"),
    "out-of-vocabulary ids": (
        "v.npy",
        lambda p: np.save(p, np.array([0, 1, 2, 2**40] * 50)),
        f"token id {2**40}",
    ),
    "one row": (
        "one.safetensors",
        lambda p: save_file({"inputs": torch.randn(1, 4), "targets": torch.tensor([1])}, str(p)),
        "holds 1 row(s)",
    ),
    "negative labels": (
        "l.safetensors",
        lambda p: save_file(
            {"inputs": torch.randn(40, 4), "targets": torch.arange(40) % 3 - 1}, str(p)
        ),
        "class label -1",
    ),
}


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(["train", "--dry-run", *args])
    return int(exc.value.code or 0), capsys.readouterr().err


def assert_one_line(code: int, err: str, expected: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("polytrain: error: ") and expected in lines[0], lines[0]


@pytest.mark.parametrize("name", sorted(NUMBERS))
def test_numbers_that_cannot_work_are_one_line(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 11, case 9 (numbers): infinities and absurd sizes used to pass the range checks.
    args, expected = NUMBERS[name]
    assert_one_line(*run(args, capsys), expected)


@pytest.mark.parametrize("name", sorted(DATA))
def test_bad_data_files_are_one_line(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 11, case 9 (data): these crashed with a traceback (or inside a worker).
    file_name, write, expected = DATA[name]
    path = _write(tmp_path / file_name, write)
    assert_one_line(*run(["--model", "mlp", "--data", str(path)], capsys), expected)


def test_every_float_field_is_checked_for_finiteness() -> None:
    # Issue 11, case 9: the check covers every float field, also from TOML / Python.
    for section, key in [
        ("optim", "beta1"),
        ("pipeline", "memory_limit_mb"),
        ("ps", "join_delay_s"),
    ]:
        with pytest.raises(ConfigError, match=f"{section}.{key} = inf"):
            job_from_dict({section: {key: float("inf")}})

"""Partition mistakes are one-line errors before launch (exit code 2), from the CLI."""

from __future__ import annotations

import pytest

from polytrain.cli.app import main

PIPELINE = ["--model", "mlp", "--nproc", "2", "--pp", "2"]  # mlp tiny: 4 blocks

CASES = {
    "sum": (["--partition", "3,4"], "pipeline.partition = [3, 4] sums to 7 but the model has 4"),
    "stages": (["--partition", "1,1,2"], "has 3 stage(s) but parallel.pp = 2"),
    "memory": (
        ["--partition", "auto", "--memory-limit-mb", "0.05"],
        "no 2-stage partition fits pipeline.memory_limit_mb = 0.05",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_partition_mistake_is_one_line(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    args, expected = CASES[name]
    with pytest.raises(SystemExit) as exc:
        main(["train", "--dry-run", *PIPELINE, *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2
    assert len(err) == 1 and err[0].startswith("polytrain: error: ")
    assert expected in err[0]


def test_auto_with_room_passes_preflight(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["train", "--dry-run", *PIPELINE, "--partition", "auto", "--memory-limit-mb", "64"])
    assert not exc.value.code, capsys.readouterr().err

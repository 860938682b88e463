"""Bad pipeline input is one line on stderr and exit code 2, before any worker starts."""

from __future__ import annotations

import pytest

from polytrain.cli.app import main
from tests.helpers.cli import assert_usage_error, run_main

PIPE = ["--model", "mlp", "--nproc", "2", "--pp", "2"]  # mlp tiny: 4 blocks

CASES = {
    "more stages than blocks": (
        ["--model", "mlp", "--nproc", "8", "--pp", "8", "--batch-size", "8"],
        "parallel.pp = 8 stages but the model has only 4 blocks",
    ),
    "micro-batches do not divide the batch": (
        [*PIPE, "--microbatches", "3", "--batch-size", "32"],
        "dp x grad_accum x microbatches = 1 x 1 x 3 = 3",
    ),
    "partition does not sum to the blocks": (
        [*PIPE, "--partition", "1,2"],
        "pipeline.partition = [1, 2] sums to 3 but the model has 4 blocks",
    ),
    "partition has the wrong number of stages": (
        [*PIPE, "--partition", "2,1,1"],
        "has 3 stage(s) but parallel.pp = 2",
    ),
    "partition with an empty stage": ([*PIPE, "--partition", "4,0"], "at least one block"),
    "unknown schedule": ([*PIPE, "--schedule", "zigzag"], "pipeline.schedule = 'zigzag'"),
    "tensor parallel inside pipedream stages": (
        ["--model", "mlp", "--nproc", "4", "--pp", "2", "--tp", "2", "--schedule", "pipedream"],
        "parallel.tp = 2 with pipeline.schedule = 'pipedream'",
    ),
    # ZeRO inside stages (pipeline.sharded): gpipe and 1f1b, one block stage per rank.
    "zero with pipedream's stashing": (
        [*PIPE, "--nproc", "4", "--zero", "3", "--schedule", "pipedream"],
        "parallel.zero = 3 with pipeline.schedule = 'pipedream': weight stashing keeps whole "
        "copies of a stage's weights, which ZeRO shards; use --schedule 1f1b",
    ),
    "zero with a zero-bubble schedule": (
        [*PIPE, "--nproc", "4", "--zero", "2", "--schedule", "zbv"],
        "parallel.zero = 2 with pipeline.schedule = 'zbv': the zero-bubble schedules split each "
        "backward in two, which ZeRO stages do not; use gpipe, 1f1b or interleaved-1f1b",
    ),
    "zero with zb-h1": (
        [*PIPE, "--nproc", "4", "--zero", "3", "--schedule", "zb-h1"],
        "parallel.zero = 3 with pipeline.schedule = 'zb-h1'",
    ),
    "zero with tensor-parallel stages": (
        ["--model", "mlp", "--nproc", "8", "--pp", "2", "--tp", "2", "--zero", "3"],
        "parallel.zero = 3 with parallel.tp = 2 and parallel.pp = 2: ZeRO stages are not "
        "tensor-parallel",
    ),
    "pipedream cannot skip a step": (
        [*PIPE, "--schedule", "pipedream", "--set", "train.on_nonfinite=skip"],
        "train.on_nonfinite = 'skip' with pipeline.schedule = 'pipedream'",
    ),
    # Several stages per rank and the I/W split (docs/pipeline.md, new schedules).
    "virtual stages with a schedule that has one per rank": (
        [*PIPE, "--schedule", "1f1b", "--virtual-stages", "2"],
        "pipeline.virtual_stages = 2 with pipeline.schedule = '1f1b'",
    ),
    "virtual stages with zbv": (
        [*PIPE, "--schedule", "zbv", "--virtual-stages", "3"],
        "(zbv always holds 2)",
    ),
    "interleaved without virtual stages": (
        [*PIPE, "--schedule", "interleaved-1f1b"],
        "interleaving needs 2 or more stages per rank; set --virtual-stages 2",
    ),
    "virtual stages x pp above the blocks": (
        [*PIPE, "--schedule", "interleaved-1f1b", "--virtual-stages", "3", "--microbatches", "2"],
        "parallel.pp = 2 x 3 = 6 stages but the model has only 4 blocks",
    ),
    "interleaved micro-batches not a multiple of pp": (
        [*PIPE, "--schedule", "interleaved-1f1b", "--virtual-stages", "2", "--microbatches", "1"],
        "interleaved 1F1B needs a multiple of num_ranks = 2",
    ),
    "partition counts per virtual stage": (
        [*PIPE, "--schedule", "zbv", "--partition", "2,2"],
        "has 2 stage(s) but parallel.pp = 2 x 2 stages per rank = 4",
    ),
    "auto partition with virtual stages": (
        [*PIPE, "--schedule", "zb-h1", "--partition", "auto"],
        "pipeline.partition = 'auto' with pipeline.schedule = 'zb-h1'",
    ),
    "tensor parallel with zbv": (
        ["--model", "mlp", "--nproc", "4", "--pp", "2", "--tp", "2", "--schedule", "zbv"],
        "parallel.tp = 2 with pipeline.schedule = 'zbv'",
    ),
    "pipedream's stashing with a zero-bubble schedule": (
        [*PIPE, "--schedule", "zb-h1", "--set", "pipeline.pipedream_update=microbatch"],
        "pipeline.pipedream_update = 'microbatch' with pipeline.schedule = 'zb-h1'",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_pipeline_input(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    args, expected = CASES[name]
    code, _, err = run_main(["train", "--dry-run", *args], capsys)
    assert_usage_error(code, err, expected)


def test_good_pipeline_job_passes(capsys: pytest.CaptureFixture[str]) -> None:
    """The same flags with valid values get through preflight (dry run prints the job)."""
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "train",
                "--dry-run",
                *PIPE,
                "--schedule",
                "1f1b",
                "--microbatches",
                "4",
                "--partition",
                "1,3",
                "--recompute",
            ]
        )
    assert exc.value.code == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert 'schedule = "1f1b"' in out
    assert "partition = [\n    1,\n    3,\n]" in out
    assert "recompute = true" in out


@pytest.mark.parametrize(
    "schedule", [["interleaved-1f1b", "--virtual-stages", "2"], ["zb-h1"], ["zbv"]]
)
def test_new_schedules_pass_preflight(
    schedule: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Four stages of mlp tiny's four blocks on two ranks get through preflight."""
    with pytest.raises(SystemExit) as exc:
        main(["train", "--dry-run", *PIPE, "--microbatches", "4", "--schedule", *schedule])
    assert exc.value.code == 0, capsys.readouterr().err
    assert f'schedule = "{schedule[0]}"' in capsys.readouterr().out


@pytest.mark.parametrize("zero", ["2", "3"])
@pytest.mark.parametrize(
    "schedule", [["gpipe"], ["1f1b"], ["interleaved-1f1b", "--virtual-stages", "2"]]
)
def test_zero_stages_pass_preflight(
    zero: str, schedule: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """ZeRO inside the stages of dp 2 x pp 2 gets through preflight (pipeline.sharded)."""
    args = ["--model", "mlp", "--nproc", "4", "--dp", "2", "--pp", "2", "--zero", zero]
    with pytest.raises(SystemExit) as exc:
        main(["train", "--dry-run", *args, "--schedule", *schedule, "--microbatches", "4"])
    assert exc.value.code == 0, capsys.readouterr().err
    assert f"zero = {zero}" in capsys.readouterr().out

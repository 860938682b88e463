"""``polytrain train`` flags are generated from the config fields (contract 2): each flag's help
is its field's help, and each flag sets its field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer

from polytrain.cli.app import app
from polytrain.cli.train import FLAG_FIELDS, resolve_job
from polytrain.config.base import describe_field
from polytrain.config.io import job_from_dict, save_job
from polytrain.config.job import JobConfig
from polytrain.errors import ConfigError


def _train() -> Any:
    """The click command typer builds (typer >= 0.20 vendors its own click)."""
    group: Any = typer.main.get_command(app)
    return group.commands["train"]


def test_every_flag_documents_its_field() -> None:
    options = {p.name: p for p in _train().params if p.param_type_name == "option"}
    for name, path in FLAG_FIELDS.items():
        info = describe_field(JobConfig, path)
        assert info.help, f"{path} has no help"
        help_text = options[name].help or ""
        assert help_text.startswith(info.help) and f"({path}, default " in help_text


def test_flags_keep_their_names_and_set_their_fields() -> None:
    argv = ["--nproc", "2", "--dp", "2", "--batch-size", "64", "--grad-accum", "2",
            "--timeout", "12.5", "--no-progress", "--partition", "3,5", "--ps-mode", "ssp",
            "--staleness", "1", "--recompute", "--sync", "allreduce", "--ps-leaves", "0"]  # fmt: skip
    ctx = _train().make_context("train", argv)
    flags = {k: v for k, v in ctx.params.items() if k in FLAG_FIELDS}
    assert set(flags) == set(FLAG_FIELDS)  # every flag exists under its old name
    job = resolve_job(None, flags, [])
    assert (job.launch.nproc, job.parallel.dp, job.train.global_batch_size) == (2, 2, 64)
    assert job.train.grad_accum == 2 and job.launch.timeout_s == 12.5
    assert job.observe.progress is False and job.parallel.recompute is True
    assert job.pipeline.partition == [3, 5] and (job.ps.mode, job.ps.staleness) == ("ssp", 1)
    assert job.optim == JobConfig().optim  # flags left out keep the defaults

    for text, value in [("host", "host"), ("2", 2)]:  # a count or a word
        job = resolve_job(None, {"sync": "ps", "nproc": "5", "ps_leaves": text}, [])
        assert job.ps.leaves == value


def test_a_bad_choice_is_the_configs_one_line_error() -> None:
    ctx = _train().make_context("train", ["--schedule", "zigzag"])
    flags = {k: v for k, v in ctx.params.items() if k in FLAG_FIELDS}
    with pytest.raises(ConfigError, match="pipeline.schedule = 'zigzag' is not a valid choice"):
        resolve_job(None, flags, [])


def test_describe_field_names_the_valid_keys() -> None:
    assert describe_field(JobConfig, "train.steps").default == 1200
    with pytest.raises(ConfigError, match="valid keys here are .*global_batch_size"):
        describe_field(JobConfig, "train.stepz")


def test_a_runs_own_job_file_runs_again_in_a_new_directory(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "first"
    run.mkdir(parents=True)
    job = job_from_dict({"observe": {"out_dir": str(run)}, "train": {"steps": 3}})
    save_job(job, run / "job.toml")
    again = resolve_job(run / "job.toml", {}, [])
    assert again.observe.out_dir == "" and again.train.steps == 3
    elsewhere = resolve_job(run / "job.toml", {"out_dir": str(tmp_path / "b")}, [])
    assert elsewhere.observe.out_dir == str(tmp_path / "b")
    # a job file kept elsewhere that names an output directory keeps it
    save_job(job, tmp_path / "job.toml")
    assert resolve_job(tmp_path / "job.toml", {}, []).observe.out_dir == str(run)


def test_a_pipeline_with_one_micro_batch_says_what_it_idles(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tests.helpers.cli import run_main

    argv = ["train", "--model", "mlp", "--pp", "2", "--nproc", "2", "--device", "cpu"]
    code, _, err = run_main([*argv, "--dry-run"], capsys)
    assert code == 0 and "1 micro-batch(es) through 2 stages leaves each stage idle 50%" in err
    code, _, err = run_main([*argv, "--microbatches", "4", "--dry-run"], capsys)
    assert code == 0 and "idle" not in err


def test_dry_run_starts_with_a_summary_and_stays_toml(capsys: pytest.CaptureFixture[str]) -> None:
    import tomllib

    from tests.helpers.cli import run_main

    code, out, err = run_main(["train", "--device", "cpu", "--nproc", "2", "--dry-run"], capsys)
    assert code == 0, err
    first, second = out.splitlines()[:2]
    assert (
        first.startswith("# gpt: ") and "M parameters; 2 rank(s)" in first and "layout dp2" in first
    )
    assert second.startswith("# predicted: ") and "ms/step" in second and "MiB per rank" in second
    assert tomllib.loads(out)["launch"]["nproc"] == 2

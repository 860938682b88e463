"""JobConfig: TOML round trip, overrides, and errors that name the key and the valid choices."""

from __future__ import annotations

from pathlib import Path

import pytest

from polytrain.config import JobConfig, job_from_dict, load_job, save_job, to_dict
from polytrain.config.io import merge, parse_override
from polytrain.errors import ConfigError, MeshError


def test_defaults_are_the_default_job() -> None:
    job = JobConfig()
    assert job.model.name == "gpt" and job.model.size == "tiny"
    assert job.launch.nproc == 2 and job.parallel.dp == 2
    assert job.data.source == "pydoc"


def test_toml_round_trip(tmp_path: Path) -> None:
    job = job_from_dict(
        {
            "model": {"name": "mlp", "n_layer": 3},
            "parallel": {"zero": 3},
            "pipeline": {"partition": [1, 2]},
            "launch": {"nproc": 4},
        }
    )
    path = tmp_path / "job.toml"
    save_job(job, path)
    again = job_from_dict(load_job(path))
    assert again == job
    assert to_dict(again) == to_dict(job)


def test_save_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text("keep me")
    with pytest.raises(ConfigError, match="already exists"):
        save_job(JobConfig(), path)
    assert path.read_text() == "keep me"


def test_unknown_key_lists_valid_keys() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'train.stepz': valid keys are train.steps"):
        job_from_dict({"train": {"stepz": 3}})
    with pytest.raises(ConfigError, match=r"unknown key 'trian'"):
        job_from_dict({"trian": {}})


def test_wrong_type_names_key_and_expected_type() -> None:
    with pytest.raises(ConfigError, match=r"train.steps = 'ten' has the wrong type: expected int"):
        job_from_dict({"train": {"steps": "ten"}})
    with pytest.raises(ConfigError, match=r"parallel.recompute = 1 has the wrong type"):
        job_from_dict({"parallel": {"recompute": 1}})


def test_literal_lists_choices() -> None:
    with pytest.raises(
        ConfigError,
        match=r"optim.name = 'lamb' is not a valid choice: expected one of 'adamw', 'sgd'",
    ):
        job_from_dict({"optim": {"name": "lamb"}})


def test_ints_widen_to_floats() -> None:
    assert job_from_dict({"optim": {"lr": 1}}).optim.lr == 1.0


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"optim": {"lr": -0.1}}, "optim.lr = -0.1"),
        ({"train": {"steps": 0}}, "train.steps = 0"),
        ({"parallel": {"zero": 1}}, "zero = 2"),
        ({"parallel": {"zero": 4}}, "expected one of 0, 2, 3"),
        ({"train": {"global_batch_size": 30}, "launch": {"nproc": 4}}, "not divisible by"),
        ({"ps": {"staleness": -1}}, "ps.staleness = -1"),
        ({"checkpoint": {"resume": True}}, "--checkpoint-dir"),
        ({"launch": {"nnodes": 2}}, "--rdzv-endpoint"),
        ({"launch": {"rdzv_endpoint": "host:70000"}}, "port number 1-65535"),
        ({"launch": {"rdzv_endpoint": "hostonly"}}, "expected HOST:PORT"),
        ({"localsgd": {"outer_lr": float("nan")}}, "localsgd.outer_lr = nan: expected a positive"),
        ({"localsgd": {"outer_lr": -0.5}}, "localsgd.outer_lr = -0.5: expected a positive"),
    ],
)
def test_invalid_values(data: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        job_from_dict(data)


def test_mesh_must_match_world() -> None:
    with pytest.raises(MeshError, match="--nproc 6"):
        job_from_dict({"parallel": {"dp": 3, "tp": 2}, "launch": {"nproc": 4}})
    job = job_from_dict({"parallel": {"tp": 2}, "launch": {"nproc": 4}})
    assert job.parallel.dp == 2


def test_overrides_parse_toml_values() -> None:
    assert parse_override("optim.lr=0.01") == (["optim", "lr"], 0.01)
    assert parse_override("pipeline.partition=[2, 3]") == (["pipeline", "partition"], [2, 3])
    assert parse_override("model.name=gpt") == (["model", "name"], "gpt")
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override("novalue")
    data: dict = {}
    merge(data, ["optim", "lr"], 0.5)
    assert data == {"optim": {"lr": 0.5}}

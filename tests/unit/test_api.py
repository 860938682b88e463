"""The Python API's `load`: overrides by ``section__key``, and a factory passed as itself."""

from __future__ import annotations

from pathlib import Path

import pytest

import polytrain
from polytrain.errors import ConfigError
from tests.helpers.hf_models import make_gpt2


def test_load_takes_a_factory_function_as_the_model() -> None:
    job = polytrain.load(model__name=make_gpt2, train__steps=7)
    assert job.model.name == "tests.helpers.hf_models:make_gpt2" and job.train.steps == 7


def test_load_refuses_a_factory_the_workers_cannot_import() -> None:
    with pytest.raises(ConfigError, match="cannot reach the worker processes"):
        polytrain.load(model__name=lambda spec: None)


def test_a_run_returns_the_weights_under_the_users_names(tmp_path: Path) -> None:
    from polytrain.comm import shutdown
    from polytrain.trainer import train

    job = polytrain.load(
        model__name="tests.helpers.models:sequential",
        train__steps=1,
        train__sample_tokens=0,
        train__eval_every=0,
        launch__nproc=1,
        observe__progress=False,
        observe__out_dir=str(tmp_path / "run"),
    )
    try:
        result = train(job)  # in-process: a one-rank gloo group, left for the caller to destroy
    finally:
        shutdown()
    assert result.state_dict is not None and result.exported is not None
    assert all(k.startswith("blocks.") for k in result.state_dict)
    assert set(result.exported) == {k.removeprefix("blocks.") for k in result.state_dict}

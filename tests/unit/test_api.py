"""The Python API's `load`: overrides by ``section__key``, and a factory passed as itself."""

from __future__ import annotations

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

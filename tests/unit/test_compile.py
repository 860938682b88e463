"""``train.compile`` without processes: blocks compiled in place (names unchanged), the
toolchain refusal as one line, ``--compile`` as a flag, and compile time set apart."""

from __future__ import annotations

import copy
import importlib.util
from functools import partial

import pytest
import torch
from torch import nn

from polytrain.cli.app import main
from polytrain.cli.train import resolve_job
from polytrain.core.compile import apply_compile, is_compiled
from polytrain.core.recompute import apply_recompute
from polytrain.errors import ConfigError
from polytrain.models.base import BlockModel
from polytrain.observe.metrics import compile_seconds
from polytrain.trainer.preflight import check_compile
from tests.conftest import small_job


def _model() -> BlockModel:
    torch.manual_seed(0)
    blocks: list[nn.Module] = [
        nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(3)
    ]
    return BlockModel([*blocks, nn.Identity()], loss_fn=lambda out, y: (out - y).pow(2).mean())


def test_compile_keeps_names_and_binds_each_block_and_its_deep_copy() -> None:
    plain = _model()
    compiled = apply_compile(copy.deepcopy(plain))
    assert list(compiled.state_dict()) == list(plain.state_dict())
    assert all(is_compiled(b) for b in list(compiled.blocks)[:3])
    assert not is_compiled(compiled.blocks[3])  # no parameters: nothing to compile
    forwards = [b.forward for b in list(compiled.blocks)[:3]]
    assert all(isinstance(f, partial) for f in forwards)
    assert len({id(f.func) for f in forwards}) == 1  # one compiled function for the three
    clone = copy.deepcopy(compiled)
    assert all(b.forward.args[0] is b for b in list(clone.blocks)[:3])  # the copy's own block
    apply_compile(compiled)  # idempotent
    assert [b.forward for b in list(compiled.blocks)[:3]] == forwards


def test_compile_after_recompute_compiles_the_checkpointed_forward() -> None:
    model = apply_compile(apply_recompute(_model()))
    block = model.blocks[0]
    assert isinstance(block.forward, partial) and block.forward.args == (block, False)
    assert is_compiled(block)


def test_a_forward_set_on_the_instance_is_the_one_compiled() -> None:
    model = _model()
    block = model.blocks[0]
    block.forward = lambda x: torch.zeros_like(x)  # as a user's library might
    apply_compile(model)
    assert is_compiled(block) and not isinstance(block.forward, partial)
    assert torch.count_nonzero(block(torch.ones(2, 8))) == 0


def test_missing_compiler_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    job = small_job(train={"compile": True})
    monkeypatch.setenv("CXX", "no-such-cxx")
    with pytest.raises(ConfigError, match=r"'no-such-cxx' .* not on PATH: .* drop --compile"):
        check_compile(job)
    check_compile(small_job())  # without compile nothing is needed
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"needs Triton .* drop --compile"):
        check_compile(job, cuda=True)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", "mlp", "--nproc", "1", "--compile", "--dry-run"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("polytrain: error: train.compile = true") and err.count("\n") == 1


def test_compile_flag_and_toml_key() -> None:
    assert resolve_job(None, {"compile": True}, []).train.compile is True
    assert resolve_job(None, {}, ["train.compile=true"]).train.compile is True
    assert resolve_job(None, {}, []).train.compile is False


def test_compile_seconds_is_the_first_step_over_a_steady_one() -> None:
    assert compile_seconds([5.0, 0.1, 0.3, 0.2]) == pytest.approx(4.8)
    assert compile_seconds([5.0]) is None  # no steady step to compare with
    assert compile_seconds([0.1, 0.2, 0.2]) == 0.0

"""`--init-from`: pretrained weights found, checked against the model by name and shape from
the files' headers, and loaded under the model's own names (models/pretrained.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from polytrain.config.io import job_from_dict
from polytrain.data.datasets import build_datasets
from polytrain.errors import ConfigError
from polytrain.models.base import BlockModel
from polytrain.models.pretrained import check_pretrained, load_pretrained, pretrained_files
from polytrain.models.registry import block_size_of, build_model
from polytrain.trainer.export import save_weights
from tests.helpers.cli import assert_usage_error, run_main


def _gpt(seed: int) -> BlockModel:
    job = job_from_dict({"model": {"name": "gpt", "size": "tiny", "n_layer": 2}})
    _, _, spec = build_datasets(job.data, block_size_of(job.model))
    return build_model(job.model, spec, seed)


def test_exported_weights_load_back_exactly(tmp_path: Path) -> None:
    trained, fresh = _gpt(1), _gpt(2)
    path = save_weights(trained.export_state(trained.state_dict()), tmp_path / "w.safetensors")
    load_pretrained(fresh, path)
    for (name, a), b in zip(trained.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_sharded_directory_loads(tmp_path: Path) -> None:
    trained, fresh = _gpt(1), _gpt(2)
    state = {k: v.contiguous() for k, v in trained.state_dict().items()}
    keys = sorted(state)
    halves = {
        "model-00001-of-00002.safetensors": keys[::2],
        "model-00002-of-00002.safetensors": keys[1::2],
    }
    for name, part in halves.items():
        save_file({k: state[k] for k in part}, str(tmp_path / name))
    index = {"weight_map": {k: name for name, part in halves.items() for k in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert len(pretrained_files(tmp_path)) == 2
    load_pretrained(fresh, tmp_path)
    assert all(torch.equal(state[k], v) for k, v in fresh.state_dict().items())


def test_mismatches_are_one_line(tmp_path: Path) -> None:
    model = _gpt(1)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    name = next(k for k in state if k.endswith("weight") and state[k].dim() == 2)
    cases = {
        "extra": ({**state, "decoder.weight": torch.zeros(2)}, "'decoder.weight' is not a weight"),
        "shape": ({**state, name: torch.zeros(3, 3)}, f"{name!r} has shape (3, 3)"),
        "missing": ({k: v for k, v in state.items() if k != name}, "the file has no"),
    }
    for case, (tensors, expected) in cases.items():
        path = tmp_path / f"{case}.safetensors"
        save_file(tensors, str(path))
        with pytest.raises(ConfigError, match=re.escape(expected)) as err:
            check_pretrained(model, path)
        assert len(str(err.value).splitlines()) == 1
    for bad, expected in [
        (tmp_path / "nope", "no such file"),
        (tmp_path / "w.bin", "expected a .safetensors file"),
        (tmp_path, "neither model.safetensors"),
    ]:
        if bad.suffix == ".bin":
            bad.write_bytes(b"")
        with pytest.raises(ConfigError, match=expected):
            pretrained_files(bad)


def test_a_tied_weight_may_be_absent_from_the_file(tmp_path: Path) -> None:
    from tests.helpers.hf_models import make_gpt2

    torch.manual_seed(3)
    hf = make_gpt2(None)
    hf.save_pretrained(tmp_path)  # lm_head.weight is tied to wte and written once
    model = BlockModel([make_gpt2(None)], lambda out, y: out, user_prefix="blocks.0.")
    load_pretrained(model, tmp_path)
    loaded = model.blocks[0]
    assert torch.equal(loaded.lm_head.weight, hf.transformer.wte.weight)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight


def test_the_cli_refuses_a_bad_path_before_launching(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_main(
        ["train", "--init-from", str(tmp_path / "nope"), "--steps", "1", "--nproc", "1",
         "--out-dir", str(tmp_path / "run"), "--device", "cpu"],
        capsys,
    )  # fmt: skip
    assert_usage_error(code, err, "model.init_from")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

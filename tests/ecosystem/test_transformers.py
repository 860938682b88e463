"""Users' own models: transformers GPT-2 (tied), Llama, BERT, ResNet (BatchNorm) and ViT,
built from tiny configs with random weights, match the single-process run under each strategy,
and their exported weights load back into the original class with no key changes (issue 12).

Tolerance: every parameter within 2e-5 (absolute) of the single-process run after 3 AdamW
steps (float32 reassociation of the all-reduced means and of the synchronised BatchNorm
statistics; a per-replica BatchNorm misses by ~1e-3).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from polytrain.testing import assert_state_close, run_job
from tests.conftest import small_job
from tests.helpers import hf_models

pytestmark = pytest.mark.slow

MODELS = ["gpt2", "llama", "bert", "resnet", "vit"]
ATOL = 2e-5
# name -> (world size, sections). tp, pp (gpipe, 1f1b) and dp x pp are not offered for these
# models yet: pre-flight refuses them in one line (see test_bad_input in this folder).
STRATEGIES: dict[str, tuple[int, dict[str, Any]]] = {
    "dp2": (2, {"parallel": {"dp": 2}}),
    "zero3-dp2": (2, {"parallel": {"dp": 2, "zero": 3}}),
    "ps-sync": (3, {"parallel": {"sync": "ps"}, "ps": {"servers": 1, "mode": "sync"}}),
}


def hf_job(model: str, data: Path, world: int = 1, **sections: dict[str, Any]) -> Any:
    base: dict[str, Any] = {
        "model": {"name": f"tests.helpers.hf_models:make_{model}"},
        "data": {"source": str(data)},
        "train": {"steps": 3, "global_batch_size": 8},
        "optim": {"name": "adamw", "lr": 1e-3},
        "launch": {"nproc": world},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return small_job(**base)


@cache
def data_file(model: str) -> Path:
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix=f"polytrain-{model}-"))
    return hf_models.write_data(model, folder / "data.safetensors")


@cache
def reference(model: str) -> dict[str, Any]:
    return run_job(hf_job(model, data_file(model)), timeout_s=300)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("model", MODELS)
def test_matches_single_process(model: str, strategy: str) -> None:
    world, sections = STRATEGIES[strategy]
    ref = reference(model)
    out = run_job(hf_job(model, data_file(model), world, **sections), timeout_s=300)
    assert out["losses"] == pytest.approx(ref["losses"], abs=ATOL)
    assert_state_close(out["state"], ref["state"], atol=ATOL)


@pytest.mark.parametrize("model", MODELS)
def test_export_loads_into_the_original_class(model: str, tmp_path: Path) -> None:
    path = tmp_path / "final.safetensors"
    job = hf_job(
        model, data_file(model), 2, parallel={"dp": 2}, checkpoint={"save_final": str(path)}
    )
    out = run_job(job, timeout_s=300)
    fresh = getattr(hf_models, f"make_{model}")(None)
    weights = load_file(str(path))
    fresh.load_state_dict(weights, strict=True)  # every key the class has, no prefix
    assert set(weights) == set(fresh.state_dict())
    for key, value in fresh.state_dict().items():  # the trained values, not the fresh ones
        expected = out["state"][f"blocks.0.{key}"]
        torch.testing.assert_close(value, expected, atol=0, rtol=0, msg=key)
    if model == "gpt2":
        assert fresh.lm_head.weight is fresh.transformer.wte.weight
        torch.testing.assert_close(weights["lm_head.weight"], weights["transformer.wte.weight"])


def test_local_batchnorm_misses_the_single_process_run() -> None:
    """The control: per-replica BatchNorm statistics (``model.batchnorm = 'local'``) drift."""
    ref = reference("resnet")
    out = run_job(
        hf_job("resnet", data_file("resnet"), 2, parallel={"dp": 2}, model={"batchnorm": "local"}),
        timeout_s=300,
    )
    with pytest.raises(AssertionError, match="differs"):
        assert_state_close(out["state"], ref["state"], atol=ATOL)

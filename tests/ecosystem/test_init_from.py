"""`--init-from` a transformers `save_pretrained` directory (issue 41): the first step's loss
is the pretrained model's own loss on that batch, under one process and under dp2, ZeRO-3, tp2
and a 1F1B pipeline, and every layout then trains as the one-process run does."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from polytrain.data.datasets import build_datasets
from polytrain.data.sampler import Batches
from polytrain.models.registry import block_size_of
from polytrain.testing import assert_state_close, run_job
from tests.ecosystem.test_transformers import data_file
from tests.helpers import hf_models
from tests.helpers.hf_models import hf_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@cache
def pretrained() -> Path:
    """A tiny GPT-2 with weights of another seed than any job's, saved as transformers does."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="polytrain-pretrained-"))
    torch.manual_seed(1234)
    hf_models.make_gpt2(None).save_pretrained(folder)
    return folder


def _job(world: int = 1, **sections: dict[str, Any]) -> Any:
    model = {"init_from": str(pretrained())}
    return hf_job("gpt2", data_file("gpt2"), world, model=model, **sections)


@cache
def reference() -> dict[str, Any]:
    return run_job(_job(), timeout_s=300)


def test_the_first_loss_is_the_pretrained_models() -> None:
    from transformers import GPT2LMHeadModel

    job = _job()
    train_set, val_set, _ = build_datasets(job.data, block_size_of(job.model))
    x, y = Batches(train_set, val_set, job.train.global_batch_size, job.train.seed).train(0)
    model = GPT2LMHeadModel.from_pretrained(pretrained())
    with torch.no_grad():
        logits = model(**x).logits
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    assert reference()["losses"][0] == pytest.approx(loss, abs=1e-5)


@pytest.mark.parametrize(
    ("world", "sections"),
    [
        (2, {"parallel": {"dp": 2}}),
        (2, {"parallel": {"dp": 2, "zero": 3}}),
        (2, {"parallel": {"tp": 2}}),
        (2, {"parallel": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}}),
    ],
    ids=["dp2", "zero3", "tp2", "1f1b-pp2"],
)
def test_every_layout_starts_from_the_pretrained_weights(
    world: int, sections: dict[str, Any]
) -> None:
    out = run_job(_job(world, **sections), timeout_s=300)
    ref = reference()
    assert out["losses"][0] == pytest.approx(ref["losses"][0], abs=1e-5)
    assert_state_close(out["state"], ref["state"], atol=2e-5)

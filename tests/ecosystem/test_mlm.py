"""Masked language modelling (issue 41, data/masking.py): BERT's masking, the same for every
layout, and a transformers BERT trained with it matching the single-process run under dp2 and
ZeRO-3; a model trained on the other objective is warned about."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch

from polytrain.config.job import DataConfig
from polytrain.data.datasets import build_datasets
from polytrain.data.masking import MaskedTokenDataset
from polytrain.errors import ConfigError
from polytrain.testing import assert_state_close, run_job
from tests.helpers.cli import run_main
from tests.helpers.hf_models import hf_job

pytestmark = [pytest.mark.timeout(600)]
T = 16


def test_each_window_predicts_k_positions_masked_as_bert() -> None:
    train, _, spec = build_datasets(DataConfig(objective="mlm"), T)
    assert isinstance(train, MaskedTokenDataset) and train.k == round(0.15 * T)
    mask = spec.vocab_size - 1  # the char tokenizer has no mask token: one is added
    x, y = train.get(torch.arange(2000))
    chosen = y != -100
    assert chosen.sum(1).eq(train.k).all()
    originals = train.tokens[torch.arange(2000).unsqueeze(1) + torch.arange(T)]
    assert torch.equal(x[~chosen], originals[~chosen])  # unchosen positions untouched
    masked = (x == mask)[chosen].float().mean().item()
    kept = (x == originals)[chosen].float().mean().item()
    assert 0.77 < masked < 0.83 and 0.08 < kept < 0.13  # 80% masked, ~10% kept (+ chance)


def test_a_sample_is_masked_alike_in_any_batch() -> None:
    train, _, _ = build_datasets(DataConfig(objective="mlm"), T)
    alone = train.get(torch.tensor([7]))
    among = train.get(torch.tensor([3, 7, 11]))
    assert torch.equal(alone[0][0], among[0][1]) and torch.equal(alone[1][0], among[1][1])


def test_a_tokenizer_without_a_mask_token_is_one_line(tmp_path: Any) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["a b c d"] * 10, trainers.BpeTrainer(special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "corpus.txt").write_text("a b c d " * 200)
    cfg = DataConfig(str(tmp_path / "corpus.txt"), tokenizer=str(tmp_path / "tok.json"))
    cfg.objective = "mlm"
    with pytest.raises(ConfigError, match="needs a mask token"):
        build_datasets(cfg, T)


def _job(world: int = 1, **sections: dict[str, Any]) -> Any:
    return hf_job(
        "bert_mlm", None, world, model={"block_size": T}, data={"objective": "mlm"}, **sections
    )


@cache
def reference() -> dict[str, Any]:
    return run_job(_job(), timeout_s=300)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"dp": 2}, {"dp": 2, "zero": 3}], ids=["dp2", "zero3"])
def test_bert_mlm_matches_the_single_process_run(parallel: dict[str, Any]) -> None:
    out = run_job(_job(2, parallel=parallel), timeout_s=300)
    ref = reference()
    assert ref["losses"][0] > 0
    assert_state_close(out["state"], ref["state"], atol=2e-5)
    assert out["losses"] == pytest.approx(ref["losses"], abs=1e-5)


def test_a_masked_lm_on_next_token_targets_is_warned_about(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["train", "--model", "tests.helpers.hf_models:make_bert_mlm", "--device", "cpu",
            "--nproc", "1", "--set", f"model.block_size={T}", "--dry-run"]  # fmt: skip
    code, out, err = run_main(argv, capsys)
    assert code == 0, err
    assert "BertForMaskedLM is a masked language model" in out + err
    assert "data.objective = 'mlm'" in out + err

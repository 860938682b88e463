"""Sequence classification from a table's `text` and `label` columns (issue 41,
[Note: text classification tables]): each row tokenized with the tokenizer's own special
tokens, cut and padded into input_ids and attention_mask; a transformers BERT classifier
trained on it matches the single-process run under dp2."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from polytrain.config.job import DataConfig
from polytrain.data.datasets import PairDataset, build_datasets
from polytrain.testing import assert_state_close, run_job
from tests.helpers.hf_models import hf_job

hf = pytest.importorskip("datasets")
T = 12
WORDS = ["good", "great", "fine", "bad", "awful", "poor"]


@cache
def files() -> tuple[Path, Path]:
    import tempfile

    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    folder = Path(tempfile.mkdtemp(prefix="polytrain-cls-"))
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(64):
        n = int(torch.randint(2, 9, (1,), generator=g))
        words = [WORDS[int(j)] for j in torch.randint(0, 6, (n,), generator=g)]
        rows.append(
            {"text": " ".join(words), "label": int(sum(w in WORDS[:3] for w in words) * 2 > n)}
        )
    (folder / "reviews.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    tok.train_from_iterator(
        [r["text"] for r in rows], trainers.WordLevelTrainer(special_tokens=special)
    )
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tok.save(str(folder / "tokenizer.json"))
    return folder / "reviews.jsonl", folder / "tokenizer.json"


def test_rows_become_padded_ids_with_their_special_tokens() -> None:
    source, tok = files()
    train, _, spec = build_datasets(DataConfig(str(source), tokenizer=str(tok)), T)
    assert isinstance(train, PairDataset) and spec.classification and spec.num_outputs == 2
    assert spec.input_names == ("input_ids", "attention_mask") and spec.vocab_size == 10
    x, y = train.get(torch.arange(4))
    assert isinstance(x, dict)
    first = json.loads(source.read_text().splitlines()[0])
    n = len(first["text"].split()) + 2
    assert x["input_ids"][0, 0] == 2 and x["input_ids"][0, n - 1] == 3  # [CLS] ... [SEP]
    assert x["attention_mask"][0].tolist() == [1] * n + [0] * (T - n)
    assert x["input_ids"][0, n:].eq(0).all() and y[0] == first["label"]  # [PAD] is id 0


def _job(world: int = 1, **sections: dict[str, Any]) -> Any:
    source, tok = files()
    data = {"tokenizer": str(tok)}
    return hf_job("bert_classifier", source, world, model={"block_size": T}, data=data, **sections)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_bert_classifier_matches_the_single_process_run() -> None:
    ref = run_job(_job(), timeout_s=300)
    out = run_job(_job(2, parallel={"dp": 2}), timeout_s=300)
    assert_state_close(out["state"], ref["state"], atol=2e-5)
    assert out["losses"] == pytest.approx(ref["losses"], abs=1e-5)

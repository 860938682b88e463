"""Corpus tables (issue 41): a JSONL ``text`` column tokenized by a real BPE tokenizer trained
here (a tokenizer.json or a transformers tokenizer directory), a Parquet token-id table, and
the mismatches between data, tokenizer and model as one-line errors (data/tables.py,
[Note: text tables])."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from polytrain.config.job import DataConfig
from polytrain.data.datasets import TokenDataset, build_datasets
from polytrain.errors import ConfigError
from tests.helpers.cli import assert_usage_error, run_main

hf = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

DOCS = [f"the quick brown fox number {i} jumps over the lazy dog" for i in range(40)]


def bpe(path: Path) -> tokenizers.Tokenizer:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=90, special_tokens=["[UNK]"]))
    tok.save(str(path))
    return tok


def corpus(path: Path, docs: list[str] = DOCS) -> Path:
    path.write_text("".join(json.dumps({"text": d, "source": "test"}) + "\n" for d in docs))
    return path


def test_a_text_column_is_tokenized_row_by_row_into_one_stream(tmp_path: Path) -> None:
    tok = bpe(tmp_path / "tokenizer.json")
    source = corpus(tmp_path / "corpus.jsonl")
    cfg = DataConfig(source=str(source), tokenizer=str(tmp_path / "tokenizer.json"))
    train, val, spec = build_datasets(cfg, 8)
    assert isinstance(train, TokenDataset) and isinstance(val, TokenDataset)
    newline = tok.encode("\n", add_special_tokens=False).ids
    expected = [i for d in DOCS for i in tok.encode(d, add_special_tokens=False).ids + newline]
    assert torch.cat([train.tokens, val.tokens]).tolist() == expected
    assert spec.kind == "tokens" and spec.vocab_size == tok.get_vocab_size()
    assert spec.decode(expected[:5]) == tok.decode(expected[:5])


def test_a_transformers_tokenizer_directory_is_a_tokenizer(tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    tok = bpe(tmp_path / "tokenizer.json")
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(tmp_path / "tok")
    source = corpus(tmp_path / "corpus.jsonl")
    from_file = build_datasets(
        DataConfig(str(source), tokenizer=str(tmp_path / "tokenizer.json")), 8
    )
    from_dir = build_datasets(DataConfig(str(source), tokenizer=str(tmp_path / "tok")), 8)
    assert torch.equal(from_dir[0].tokens, from_file[0].tokens)  # type: ignore[union-attr]
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="holds no tokenizer.json"):
        build_datasets(DataConfig(str(source), tokenizer=str(tmp_path)), 8)


def test_a_parquet_token_table_is_used_as_is(tmp_path: Path) -> None:
    tok = bpe(tmp_path / "tokenizer.json")
    ids = [tok.encode(d).ids for d in DOCS]
    hf.Dataset.from_dict({"input_ids": ids}).to_parquet(str(tmp_path / "tokens.parquet"))
    source = str(tmp_path / "tokens.parquet")
    train, val, spec = build_datasets(DataConfig(source), 8)  # no tokenizer: ids as they are
    assert torch.cat([train.tokens, val.tokens]).tolist() == [i for row in ids for i in row]  # type: ignore[union-attr]
    assert spec.vocab_size == max(max(r) for r in ids) + 1
    _, _, spec = build_datasets(DataConfig(source, tokenizer=str(tmp_path / "tokenizer.json")), 8)
    assert spec.vocab_size == tok.get_vocab_size()


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"input_ids": [1, 2, 500]}], "holds token id 500, outside [0, the tokenizer's"),
        ([{"input_ids": []}, {"input_ids": []}], "column 'input_ids' is empty"),
        ([{"text": ""}, {"text": ""}], "column 'text' gives no tokens"),
        ([{"text": 3}, {"text": 4}], "column 'text' does not hold strings"),
    ],
    ids=["id past the vocabulary", "empty ids", "empty text", "numbers as text"],
)
def test_corpus_mismatches_are_one_line(
    tmp_path: Path, rows: list[dict[str, object]], message: str
) -> None:
    bpe(tmp_path / "tokenizer.json")
    source = tmp_path / "bad.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(str(source), tokenizer=str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")) as info:
        build_datasets(cfg, 4)
    assert "\n" not in str(info.value)


def test_a_model_smaller_than_the_vocabulary_is_refused_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bpe(tmp_path / "tokenizer.json")
    source = corpus(tmp_path / "corpus.jsonl")
    argv = ["train", "--model", "tests.helpers.hf_models:make_gpt2", "--data", str(source),
            "--tokenizer", str(tmp_path / "tokenizer.json"), "--nproc", "1", "--device", "cpu",
            "--steps", "1", "--set", "model.block_size=8", "--out-dir", str(tmp_path / "run")]  # fmt: skip
    code, _, err = run_main(argv, capsys)
    assert_usage_error(code, err, "the model's embedding table holds 48")


def test_the_cli_trains_on_a_tokenized_corpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bpe(tmp_path / "tokenizer.json")
    source = corpus(tmp_path / "corpus.jsonl")
    argv = ["train", "--data", str(source), "--tokenizer", str(tmp_path / "tokenizer.json"),
            "--nproc", "1", "--device", "cpu", "--steps", "3", "--no-progress",
            "--set", "model.block_size=8", "--out-dir", str(tmp_path / "run")]  # fmt: skip
    code, _, err = run_main(argv, capsys)
    assert code == 0, err
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert records[-1]["step"] == 3 and records[-1]["loss"] > 0

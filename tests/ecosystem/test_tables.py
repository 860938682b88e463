"""JSONL / Parquet / Arrow data sets through Hugging Face ``datasets`` (docs/models.md, Inputs):
integer columns stay integer, list columns become (rows, length) tensors, and text or ragged
columns are one-line errors. In process; skipped where ``datasets`` is not installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from polytrain.config.job import DataConfig
from polytrain.data.datasets import build_datasets
from polytrain.errors import ConfigError

hf = pytest.importorskip("datasets")

ROWS = [
    {"input_ids": [i, i + 1, i + 2, 7], "attention_mask": [1, 1, 1, 0], "scale": 0.5 * i}
    | {"targets": i % 3}
    for i in range(12)
]


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".arrow"])
def test_tables_keep_integer_inputs_integer(tmp_path: Path, suffix: str) -> None:
    source = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    if suffix != ".jsonl":
        table = hf.Dataset.from_json(str(source), keep_in_memory=True)
        if suffix == ".parquet":
            source = tmp_path / "rows.parquet"
            table.to_parquet(str(source))
        else:
            table.save_to_disk(str(tmp_path / "saved"))
            source = next((tmp_path / "saved").glob("*.arrow"))
    train, val, spec = build_datasets(DataConfig(source=str(source), val_fraction=0.25), 4)
    assert (len(train), len(val)) == (9, 3)
    assert spec.input_names == ("attention_mask", "input_ids", "scale")
    assert spec.classification and spec.num_outputs == 3
    x, y = train.get(torch.arange(2))
    assert isinstance(x, dict)
    assert x["input_ids"].dtype == torch.int64 and x["input_ids"].tolist()[1] == [1, 2, 3, 7]
    assert x["attention_mask"].shape == (2, 4) and x["scale"].dtype == torch.float32
    assert y.dtype == torch.int64 and y.tolist() == [0, 1]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"name": "hi", "targets": 1}, {"name": "ho", "targets": 0}], "column 'name' holds str"),
        ([{"text": "hi", "label": 0.5}, {"text": "ho", "label": 1.5}], "one integer class per row"),
        (
            [{"input_ids": [1, 2], "targets": 1}, {"input_ids": [1], "targets": 0}],
            "column 'input_ids' holds rows of different shapes",
        ),
        ([{"pixels": [1, 2]}, {"pixels": [3, 4]}], "a corpus needs a 'text' or input_ids"),
    ],
    ids=["text", "float labels", "ragged", "neither corpus nor targets"],
)
def test_bad_tables_are_one_line_errors(
    tmp_path: Path, rows: list[dict[str, object]], message: str
) -> None:
    source = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ConfigError, match=message) as info:
        build_datasets(DataConfig(source=str(source)), 4)
    assert "\n" not in str(info.value)

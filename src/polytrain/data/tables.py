"""JSON Lines, Parquet and Arrow data sets through Hugging Face ``datasets``, read from local files.

Two kinds of table:

* **Language-model corpora** (no ``targets`` column): a ``text`` column is tokenized by the
  job's tokenizer (``data.tokenizer``; through ``datasets``' ``map``, batched, cached by
  ``datasets`` under its cache directory, in several processes for large tables), or a token
  column (``input_ids`` or ``tokens``, lists of any lengths) is used as is; the rows are
  concatenated into one token stream that next-token prediction reads in windows of the
  model's context, as a text file is ([Note: text tables]).
* **Supervised tables**, like a ``.safetensors`` data set (`data.tensors`): a ``targets``
  column and either an ``inputs`` column or named input columns (``input_ids``,
  ``attention_mask``...). Each column becomes one tensor with a first dim of rows; a column of
  equal-length lists becomes a (rows, length) tensor. dtypes are kept: integer columns stay
  int64 (token ids), floating columns become float32. Text columns and ragged lists are
  one-line errors there (tokenize and pad first). ``datasets`` is optional (``pip install datasets``); without it these files are a
one-line error naming the install.

[Note: optional import] ``datasets`` takes seconds to import (pandas, pyarrow) and most jobs
never read a table, so it is imported by name (``importlib``) when a table is read, not at the
top of the module.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import torch

from polytrain.data.tokenize import load_tokenizer, tokenize
from polytrain.errors import ConfigError

__all__ = [
    "LABEL_COLUMNS",
    "TABLE_SUFFIXES",
    "TOKEN_COLUMNS",
    "read_table",
    "table_tokens",
    "text_classification",
]

TABLE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
TOKEN_COLUMNS = ("input_ids", "tokens")  # a corpus already tokenized
LABEL_COLUMNS = ("targets", "label", "labels")  # a supervised table's targets, first found
_PARALLEL_ROWS = 20_000  # rows from which tokenizing uses several processes


def _datasets(source: str) -> Any:
    try:
        module = importlib.import_module("datasets")  # [Note: optional import]
    except ImportError:
        raise ConfigError(
            f"data.source = {source!r} is a table read through Hugging Face datasets, which is "
            "not installed: pip install datasets (or convert it to .safetensors)"
        ) from None
    module.disable_progress_bars()
    module.logging.set_verbosity_error()
    return module


def _open(path: Path, source: str, *, in_memory: bool = True) -> Any:
    hf = _datasets(source)
    try:
        if path.suffix == ".parquet":
            return hf.Dataset.from_parquet(str(path), keep_in_memory=in_memory)
        if path.suffix == ".arrow":  # datasets' own Arrow files (Dataset.save_to_disk)
            return hf.Dataset.from_file(str(path), in_memory=in_memory)
        return hf.Dataset.from_json(str(path), keep_in_memory=in_memory)
    except Exception as exc:  # datasets raises many types for a malformed file
        detail = str(exc).splitlines()[0][:100] if str(exc) else type(exc).__name__
        raise ConfigError(
            f"data.source = {source!r} could not be read as {path.suffix[1:]} ({detail}): "
            "check the file, one JSON object per line for .jsonl"
        ) from None


def read_table(path: Path, source: str) -> dict[str, torch.Tensor]:
    """Every column of the table at ``path`` as a tensor (a `ConfigError` naming a bad column)."""
    table = _open(path, source)
    columns = table.with_format("torch")[:]
    out: dict[str, torch.Tensor] = {}
    for name, column in columns.items():
        if isinstance(column, torch.Tensor):
            out[name] = column
            continue
        first = column[0] if len(column) else None
        if isinstance(first, torch.Tensor):
            shapes = sorted({tuple(c.shape) for c in column})
            fix = f"rows of different shapes {shapes[:3]}: pad them to one length"
        else:
            fix = f"{type(first).__name__} values: tokenize text into integer ids first"
        raise ConfigError(f"data.source = {source!r}: column {name!r} holds {fix}")
    if "targets" not in out:  # datasets' usual name for the classes
        label = next((c for c in LABEL_COLUMNS if c in out), None)
        if label is not None:
            out["targets"] = out.pop(label)
    return out


# [Note: text tables]
# A corpus table is one document per row. Rows are tokenized independently (a document's last
# token never merges with the next one's first) and concatenated in row order into one stream,
# a newline's tokens between documents for the char, byte and tokenizer.json tokenizers alike,
# so a table and the text file of the same documents joined by newlines give the same windows
# up to merges across those boundaries. The vocabulary is the tokenizer's (char: the distinct
# characters of the table); a token column's ids must lie below it (without a tokenizer: below
# MAX_VOCAB, the vocabulary then being the largest id plus one, as a .npy token array's).
def table_tokens(
    path: Path, source: str, tokenizer: str, max_vocab: int
) -> tuple[torch.Tensor, int, list[str]] | None:
    """The token stream of a corpus table (a ``text`` or token column, no ``targets``) with its
    vocabulary size and, for the char tokenizer, its characters; None for a supervised table."""
    table = _open(path, source, in_memory=False)  # on disk: datasets caches the tokenization
    names = table.column_names
    if any(c in names for c in LABEL_COLUMNS):
        return None
    where = f"data.source = {source!r}"
    if len(table) == 0:
        raise ConfigError(f"{where} has no rows")
    if "text" in names:
        return _tokenize_text(table, where, tokenizer)
    column = next((c for c in TOKEN_COLUMNS if c in names), None)
    if column is None:
        raise ConfigError(
            f"{where} has columns {names}: a corpus needs a 'text' or {' / '.join(TOKEN_COLUMNS)} "
            "column; a supervised table a 'targets' column"
        )
    return _token_column(table, column, where, tokenizer, max_vocab)


def _tokenize_text(table: Any, where: str, tokenizer: str) -> tuple[torch.Tensor, int, list[str]]:
    if not all(isinstance(t, str) for t in table.select(range(min(8, len(table))))["text"]):
        raise ConfigError(f"{where}: column 'text' does not hold strings")
    if tokenizer in ("char", "byte"):
        text = "\n".join(table["text"])
        if not text:
            raise ConfigError(f"{where}: column 'text' is empty")
        return tokenize(text, tokenizer)
    tok = load_tokenizer(tokenizer)
    newline = tok.encode("\n", add_special_tokens=False).ids

    def encode(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        encoded = tok.encode_batch(batch["text"], add_special_tokens=False)
        return {"ids": [e.ids + newline for e in encoded]}

    procs = min(os.cpu_count() or 1, 8) if len(table) >= _PARALLEL_ROWS else None
    ids = table.map(encode, batched=True, remove_columns=table.column_names, num_proc=procs)
    stream = _flatten(ids, "ids", where)
    if len(stream) == 0:
        raise ConfigError(f"{where}: column 'text' gives no tokens")
    return stream, int(tok.get_vocab_size()), []


def _token_column(
    table: Any, column: str, where: str, tokenizer: str, max_vocab: int
) -> tuple[torch.Tensor, int, list[str]]:
    stream = _flatten(table, column, where)
    if len(stream) == 0:
        raise ConfigError(f"{where}: column {column!r} is empty")
    vocab = (
        max_vocab
        if tokenizer in ("char", "byte")
        else int(load_tokenizer(tokenizer).get_vocab_size())
    )
    low, high = int(stream.min()), int(stream.max())
    if low < 0 or high >= vocab:
        named = f"the tokenizer's vocabulary of {vocab}" if vocab != max_vocab else f"{max_vocab}"
        raise ConfigError(
            f"{where}: column {column!r} holds token id {low if low < 0 else high}, outside "
            f"[0, {named}): the ids and the tokenizer (data.tokenizer) must match"
        )
    if tokenizer in ("char", "byte"):
        vocab = high + 1
    return stream.to(torch.long), vocab, []


def _flatten(table: Any, column: str, where: str) -> torch.Tensor:
    """One column of integer lists (or integers), all rows' values in order."""
    array = table.data.column(column).combine_chunks()
    if str(array.type).startswith(("list", "large_list")):
        array = array.flatten()
    if len(array) == 0 or str(array.type) == "null":
        return torch.empty(0, dtype=torch.long)
    values = array.to_numpy(zero_copy_only=False)
    if values.dtype.kind not in "iu":
        raise ConfigError(f"{where}: column {column!r} holds {array.type}, not token ids")
    return torch.from_numpy(values.astype("int64"))


# [Note: text classification tables]
# A table with a `text` column and a label column (`targets`, `label` or `labels`, integer
# classes) is a sequence-classification data set: each row's text is tokenized on its own (a
# tokenizer.json adds its special tokens, e.g. BERT's [CLS] and [SEP]), cut to the model's
# context and padded with the tokenizer's [PAD] / <pad> (else id 0) into `input_ids` and
# `attention_mask` named inputs, the model's keyword arguments.
def text_classification(
    path: Path, source: str, tokenizer: str, block_size: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor, int, int] | None:
    """(named inputs, targets, rows, vocabulary size) of a text classification table; None for
    any other table."""
    table = _open(path, source)
    names = table.column_names
    label = next((c for c in LABEL_COLUMNS if c in names), None)
    if label is None or "text" not in names:
        return None
    where = f"data.source = {source!r}"
    texts = table["text"]
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ConfigError(f"{where}: column 'text' must hold a string in every row")
    targets = torch.tensor(table[label])
    if targets.is_floating_point() or targets.dim() != 1:
        raise ConfigError(f"{where}: column {label!r} must hold one integer class per row")
    if tokenizer in ("char", "byte"):
        _, vocab, itos = tokenize("\n".join(texts), tokenizer)
        stoi = {ch: i for i, ch in enumerate(itos)}
        rows = [[stoi[c] for c in t] if itos else list(t.encode("utf-8")) for t in texts]
        pad = 0
    else:
        tok = load_tokenizer(tokenizer)
        rows = [e.ids for e in tok.encode_batch(texts)]
        vocab = int(tok.get_vocab_size())
        pad = next(
            (tok.token_to_id(n) for n in ("[PAD]", "<pad>") if tok.token_to_id(n) is not None), 0
        )
    ids = torch.full((len(rows), block_size), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), block_size), dtype=torch.long)
    for i, row in enumerate(rows):
        row = row[:block_size]
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return {"input_ids": ids, "attention_mask": mask}, targets.to(torch.long), len(rows), vocab

"""Text to token ids: characters (the default), UTF-8 bytes, or a local ``tokenizer.json``.

``data.tokenizer = "char"`` numbers the distinct characters of the text (small vocabularies,
the built-in corpus); ``"byte"`` uses the 256 UTF-8 byte values (any text, fixed vocabulary);
a path to a ``tokenizer.json`` (Hugging Face ``tokenizers``, read locally, nothing
downloaded) gives that tokenizer's ids and vocabulary size.
"""

from __future__ import annotations

from pathlib import Path

import torch

from polytrain.errors import ConfigError

__all__ = ["Tokenized", "decode", "tokenize"]

Tokenized = tuple[torch.Tensor, int, list[str]]  # (ids (N,), vocabulary size, itos for "char")


def tokenize(text: str, tokenizer: str) -> Tokenized:
    if tokenizer == "char":
        itos = sorted(set(text))
        stoi = {ch: i for i, ch in enumerate(itos)}
        return torch.tensor([stoi[ch] for ch in text], dtype=torch.long), len(itos), itos
    if tokenizer == "byte":
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long), 256, []
    tok = _load(tokenizer)
    return torch.tensor(tok.encode(text).ids, dtype=torch.long), tok.get_vocab_size(), []


def decode(ids: list[int], tokenizer: str, itos: list[str]) -> str:
    if tokenizer == "char" or not tokenizer:
        return "".join(itos[i] for i in ids) if itos else " ".join(map(str, ids))
    if tokenizer == "byte":
        return bytes(ids).decode("utf-8", errors="replace")
    return str(_load(tokenizer).decode(ids))


def _load(path: str):  # type: ignore[no-untyped-def]  # tokenizers ships no type hints
    if not Path(path).is_file():
        raise ConfigError(
            f"data.tokenizer = {path!r}: expected 'char', 'byte' or the path of a local "
            "tokenizer.json"
        )
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(
            f"data.tokenizer = {path!r} needs the 'tokenizers' package: pip install tokenizers"
        ) from None
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # the file's content: one line
        raise ConfigError(
            f"data.tokenizer = {path!r} is not a tokenizers JSON file ({str(exc)[:80]})"
        ) from None

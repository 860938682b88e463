"""Text to token ids: characters (the default), UTF-8 bytes, or a local tokenizer.

``data.tokenizer = "char"`` numbers the distinct characters of the text (small vocabularies,
the built-in corpus); ``"byte"`` uses the 256 UTF-8 byte values (any text, fixed vocabulary);
a path to a ``tokenizer.json`` (Hugging Face ``tokenizers``), or to a transformers tokenizer
directory holding one (what a fast tokenizer's ``save_pretrained`` writes), gives that
tokenizer's ids and vocabulary size. Everything is read locally; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch

from polytrain.errors import ConfigError

__all__ = ["Tokenized", "decode", "load_tokenizer", "tokenize"]

Tokenized = tuple[torch.Tensor, int, list[str]]  # (ids (N,), vocabulary size, itos for "char")


def tokenize(text: str, tokenizer: str) -> Tokenized:
    if tokenizer == "char":
        itos = sorted(set(text))
        stoi = {ch: i for i, ch in enumerate(itos)}
        return torch.tensor([stoi[ch] for ch in text], dtype=torch.long), len(itos), itos
    if tokenizer == "byte":
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long), 256, []
    tok = load_tokenizer(tokenizer)
    return torch.tensor(tok.encode(text).ids, dtype=torch.long), tok.get_vocab_size(), []


def decode(ids: list[int], tokenizer: str, itos: list[str]) -> str:
    if tokenizer == "char" or not tokenizer:
        return "".join(itos[i] for i in ids) if itos else " ".join(map(str, ids))
    if tokenizer == "byte":
        return bytes(ids).decode("utf-8", errors="replace")
    return str(load_tokenizer(tokenizer).decode(ids))


def load_tokenizer(path: str):  # type: ignore[no-untyped-def]  # tokenizers ships no type hints
    """The `tokenizers.Tokenizer` of a ``tokenizer.json`` file or of a directory holding one."""
    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        where = "holds no tokenizer.json (save a fast tokenizer)" if Path(path).is_dir() else ""
        raise ConfigError(
            f"data.tokenizer = {path!r}{': ' + where if where else ''}: expected 'char', "
            "'byte', a tokenizer.json or a transformers tokenizer directory"
        )
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(
            f"data.tokenizer = {path!r} needs the 'tokenizers' package: pip install tokenizers"
        ) from None
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the file's content: one line
        raise ConfigError(
            f"data.tokenizer = {path!r} is not a tokenizers JSON file ({str(exc)[:80]})"
        ) from None

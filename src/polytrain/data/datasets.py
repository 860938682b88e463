"""Datasets: character-level text, integer token arrays, and (inputs, targets) tensor pairs
(images among them: the built-in digits, or a user's .safetensors / .npz).

Shapes: B batch, T context length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from polytrain.config.job import DataConfig
from polytrain.data.corpus import default_corpus
from polytrain.data.images import load_digits_pairs
from polytrain.data.masking import MaskedTokenDataset, mask_token
from polytrain.data.tables import TABLE_SUFFIXES, table_tokens, text_classification
from polytrain.data.tensors import (
    MAX_VOCAB,
    Pairs,
    load_numpy_array_pairs,
    load_numpy_pairs,
    load_tensor_pairs,
    targets_beside,
)
from polytrain.data.tokenize import decode, tokenize
from polytrain.errors import ConfigError

__all__ = ["MAX_VOCAB", "DataSpec", "Inputs", "PairDataset", "TokenDataset", "build_datasets"]


@dataclass(frozen=True)
class DataSpec:
    """What a model factory needs to know about the data."""

    kind: str  # "tokens" (next-token prediction) or "pairs" (supervised)
    vocab_size: int = 0
    input_shape: tuple[int, ...] = ()
    num_outputs: int = 0
    classification: bool = True
    itos: list[str] = field(default_factory=list)
    input_names: tuple[str, ...] = ()
    tokenizer: str = ""  # how text became ids (data.tokenizer); "" for non-text data  # named inputs (keyword arguments); () = one tensor

    def decode(self, ids: list[int]) -> str:
        return decode(ids, self.tokenizer, self.itos)


class TokenDataset:
    """Windows of a 1-D token stream: sample i is ``tokens[i : i + T]`` -> ``tokens[i+1 : i+T+1]``."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        self.tokens = tokens.to(torch.long)
        self.block_size = block_size
        self.num_samples = len(self.tokens) - block_size
        if self.num_samples < 1:
            raise ConfigError(
                f"data has {len(self.tokens)} tokens, too few for a context of {block_size}: "
                "use a larger data set or a smaller model.block_size"
            )

    def __len__(self) -> int:
        return self.num_samples

    def get(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = torch.arange(self.block_size + 1)
        windows = self.tokens[indices.unsqueeze(1) + offsets]  # (B, T+1)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


Inputs = torch.Tensor | dict[str, torch.Tensor]  # one tensor, or named ones (keyword arguments)


def _rows(inputs: Inputs, start: int, stop: int) -> Inputs:
    if isinstance(inputs, torch.Tensor):
        return inputs[start:stop]
    return {k: v[start:stop] for k, v in inputs.items()}


class PairDataset:
    """Rows of an (inputs, targets) pair: inputs one tensor or several named ones."""

    def __init__(self, inputs: Inputs, targets: torch.Tensor) -> None:
        self.inputs, self.targets = inputs, targets
        self.num_samples = len(targets)

    def __len__(self) -> int:
        return self.num_samples

    def get(self, indices: torch.Tensor) -> tuple[Inputs, torch.Tensor]:
        if isinstance(self.inputs, torch.Tensor):
            return self.inputs[indices], self.targets[indices]
        return {k: v[indices] for k, v in self.inputs.items()}, self.targets[indices]


Dataset = TokenDataset | PairDataset | MaskedTokenDataset


def _split(n: int, val_fraction: float) -> int:
    return max(1, min(n - 1, round(n * (1.0 - val_fraction))))


def _text_datasets(
    text: str, cfg: DataConfig, block_size: int
) -> tuple[Dataset, Dataset, DataSpec]:
    return _stream_datasets(tokenize(text, cfg.tokenizer), cfg, block_size)


def _stream_datasets(
    tokenized: tuple[torch.Tensor, int, list[str]], cfg: DataConfig, block_size: int
) -> tuple[Dataset, Dataset, DataSpec]:
    if cfg.objective == "mlm":
        return _masked_datasets(tokenized, cfg, block_size)
    tokens, vocab_size, itos = tokenized
    cut = _split(len(tokens), cfg.val_fraction)
    spec = DataSpec(
        kind="tokens",
        vocab_size=vocab_size,
        input_shape=(block_size,),
        itos=itos,
        tokenizer=cfg.tokenizer,
    )
    return TokenDataset(tokens[:cut], block_size), TokenDataset(tokens[cut:], block_size), spec


def _masked_datasets(
    tokenized: tuple[torch.Tensor, int, list[str]], cfg: DataConfig, block_size: int
) -> tuple[Dataset, Dataset, DataSpec]:
    """Masked language modelling over the stream (`data.masking`)."""
    tokens, vocab_size, itos = tokenized
    mask_id, vocab = mask_token(cfg.tokenizer, vocab_size)
    cut = _split(len(tokens), cfg.val_fraction)

    def masked(part: torch.Tensor, offset: int) -> MaskedTokenDataset:
        return MaskedTokenDataset(
            part, block_size, mask_id=mask_id, vocab_size=vocab_size,
            fraction=cfg.mask_fraction, seed=0, offset=offset,
        )  # fmt: skip

    spec = DataSpec(
        kind="tokens",
        vocab_size=vocab,
        input_shape=(block_size,),
        itos=[*itos, "[MASK]"] if itos and mask_id == len(itos) else itos,
        tokenizer=cfg.tokenizer,
    )
    return masked(tokens[:cut], 0), masked(tokens[cut:], cut), spec


def _load_tokens(path: Path, source: str) -> torch.Tensor:
    """A 1-D integer token array from ``.npy`` with ids in ``[0, MAX_VOCAB)`` (else `ConfigError`)."""
    try:
        array = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        # Object arrays (and anything else numpy would need pickle for) land here too: we
        # never unpickle data.
        raise ConfigError(
            f"data.source = {source!r} is not a readable numeric .npy array "
            f"({str(exc).split('. ')[0][:80]}): save a 1-D integer array with numpy.save"
        ) from None
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise ConfigError(
            f"data.source = {source!r} holds a {array.dtype} array of shape "
            f"{array.shape}: a .npy data set alone must be a 1-D integer token array (images: "
            f"put their labels beside it in {targets_beside(path).name}, or both in one .npz)"
        )
    if len(array) < 2:
        raise ConfigError(
            f"data.source = {source!r} holds {len(array)} token(s): need enough tokens for "
            "a training and a validation split"
        )
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= MAX_VOCAB:
        bad = low if low < 0 else high
        raise ConfigError(
            f"data.source = {source!r} holds token id {bad}: ids must lie in [0, {MAX_VOCAB}) "
            "(they index the embedding table); re-encode the tokens"
        )
    return torch.from_numpy(array.astype(np.int64))


def build_datasets(cfg: DataConfig, block_size: int) -> tuple[Dataset, Dataset, DataSpec]:
    """Train and validation datasets (a fixed split: the last ``val_fraction`` is validation)."""
    if cfg.source == "pydoc":
        return _text_datasets(default_corpus(), cfg, block_size)
    if cfg.source == "digits":  # [Note: fixed image split] in data.images
        images, labels = load_digits_pairs()
        return _pair_datasets((images, labels, len(labels)), cfg)
    path = Path(cfg.source)
    if not path.is_file():
        raise ConfigError(
            f"data.source = {cfg.source!r} does not exist: give 'pydoc', 'digits' or the path "
            "of a text, .npy, .safetensors, .npz, .jsonl, .parquet or .arrow file"
        )
    if path.suffix == ".npy" and targets_beside(path).is_file():  # inputs with their labels
        return _pair_datasets(load_numpy_array_pairs(path, cfg.source), cfg)
    if path.suffix == ".npy":
        tokens = _load_tokens(path, cfg.source)
        cut = _split(len(tokens), cfg.val_fraction)
        vocab = int(tokens.max()) + 1
        spec = DataSpec(kind="tokens", vocab_size=vocab, input_shape=(block_size,))
        return TokenDataset(tokens[:cut], block_size), TokenDataset(tokens[cut:], block_size), spec
    if path.suffix in TABLE_SUFFIXES:
        corpus = table_tokens(path, cfg.source, cfg.tokenizer, MAX_VOCAB)
        if corpus is not None:  # [Note: text tables]
            return _stream_datasets(corpus, cfg, block_size)
        labelled = text_classification(path, cfg.source, cfg.tokenizer, block_size)
        if labelled is not None:  # [Note: text classification tables]
            inputs, targets, rows, vocab = labelled
            return _pair_datasets((inputs, targets, rows), cfg, vocab_size=vocab)
    if path.suffix == ".safetensors" or path.suffix in TABLE_SUFFIXES:
        return _pair_datasets(load_tensor_pairs(path, cfg.source), cfg)
    if path.suffix == ".npz":
        return _pair_datasets(load_numpy_pairs(path, cfg.source), cfg)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(
            f"data.source = {cfg.source!r} is not UTF-8 text, .npy, .safetensors or .npz"
        ) from None
    return _text_datasets(text, cfg, block_size)


def _pair_datasets(
    pairs: Pairs, cfg: DataConfig, vocab_size: int = 0
) -> tuple[Dataset, Dataset, DataSpec]:
    """Train and validation rows of checked ``(inputs, targets, rows)``: the last
    ``val_fraction`` of the rows is validation."""
    inputs, targets, rows = pairs
    classification = not targets.is_floating_point()
    num_outputs = (
        int(targets.max()) + 1
        if classification
        else (1 if targets.ndim == 1 else int(targets.shape[-1]))
    )
    cut = _split(rows, cfg.val_fraction)
    first = inputs if isinstance(inputs, torch.Tensor) else next(iter(inputs.values()))
    spec = DataSpec(
        kind="pairs",
        vocab_size=vocab_size,
        input_shape=tuple(first.shape[1:]),
        num_outputs=num_outputs,
        classification=classification,
        input_names=() if isinstance(inputs, torch.Tensor) else tuple(inputs),
    )
    return (
        PairDataset(_rows(inputs, 0, cut), targets[:cut]),
        PairDataset(_rows(inputs, cut, rows), targets[cut:]),
        spec,
    )

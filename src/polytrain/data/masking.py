"""Masked language modelling (``data.objective = "mlm"``; Devlin et al., BERT, NAACL 2019).

Each window of the token stream keeps its tokens as the input, except ``k`` chosen positions:
80% of them become the mask token, 10% a random token, 10% stay; the targets are the original
tokens at those ``k`` positions and -100 (not predicted) elsewhere.

[Note: masks that do not depend on the layout] The choice is a function of the sample's
position in the stream only (its own generator per sample), so every layout masks a sample the
same way (contract 1). It is the same in every epoch: BERT's static masking (RoBERTa's dynamic
masking would also need the step). Every window predicts exactly ``k = round(fraction * T)``
positions rather than a random count, so a replica's or micro-batch's mean loss over its
predicted positions averages to the global batch's mean whatever the split, as the causal loss
does.

The mask token is the tokenizer's ``[MASK]`` or ``<mask>``; the char and byte tokenizers and
token arrays have none, so id ``vocab_size`` is added for it (the vocabulary grows by one).
"""

from __future__ import annotations

import torch

from polytrain.data.tokenize import load_tokenizer
from polytrain.errors import ConfigError

__all__ = ["MaskedTokenDataset", "mask_token"]

MASK_NAMES = ("[MASK]", "<mask>")


def mask_token(tokenizer: str, vocab_size: int) -> tuple[int, int]:
    """(mask id, vocabulary size with it) for ``tokenizer``."""
    if tokenizer in ("char", "byte", ""):
        return vocab_size, vocab_size + 1
    tok = load_tokenizer(tokenizer)
    for name in MASK_NAMES:
        ident = tok.token_to_id(name)
        if ident is not None:
            return int(ident), vocab_size
    raise ConfigError(
        f"data.objective = 'mlm' needs a mask token and data.tokenizer = {tokenizer!r} has "
        f"none of {', '.join(MASK_NAMES)}: train the tokenizer with one as a special token"
    )


class MaskedTokenDataset:
    """Windows of a token stream, masked as BERT does; see the module docstring."""

    def __init__(
        self,
        tokens: torch.Tensor,
        block_size: int,
        *,
        mask_id: int,
        vocab_size: int,
        fraction: float,
        seed: int,
        offset: int = 0,
    ) -> None:
        self.tokens = tokens.to(torch.long)
        self.block_size = block_size
        self.num_samples = len(self.tokens) - block_size + 1
        if self.num_samples < 1:
            raise ConfigError(
                f"data has {len(self.tokens)} tokens, too few for a context of {block_size}: "
                "use a larger data set or a smaller model.block_size"
            )
        self.mask_id, self.vocab_size = mask_id, vocab_size
        self.k = max(1, round(fraction * block_size))
        self.seed, self.offset = seed, offset  # offset: the split's first sample, for the seed

    def __len__(self) -> int:
        return self.num_samples

    def get(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.block_size
        windows = self.tokens[indices.unsqueeze(1) + torch.arange(t)]  # (B, T)
        inputs = windows.clone()
        targets = torch.full_like(windows, -100)
        for row, index in enumerate(indices.tolist()):
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.offset + index)
            chosen = torch.randperm(t, generator=g)[: self.k]
            action = torch.rand(self.k, generator=g)
            randoms = torch.randint(0, self.vocab_size, (self.k,), generator=g)
            targets[row, chosen] = windows[row, chosen]
            masked = chosen[action < 0.8]
            replaced = (action >= 0.8) & (action < 0.9)
            inputs[row, masked] = self.mask_id
            inputs[row, chosen[replaced]] = randoms[replaced]
        return inputs, targets

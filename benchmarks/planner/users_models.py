"""A user's own model for the planner benchmark (`main.py --models gpt2`): transformers' GPT-2
built from a config with random weights (no download), about the default job's size, on the
default corpus (its characters are the vocabulary). No dropout, as the parity tests run it."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def gpt2(spec: Any, n_layer: int = 4, n_embd: int = 128, n_head: int = 4) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        vocab_size=spec.vocab_size,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)

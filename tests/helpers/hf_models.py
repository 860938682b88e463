"""Real transformers models from tiny configs with random weights (no downloads), as factories.

Each ``make_<name>(spec, **args)`` is a polytrain model factory (``model.name =
"tests.helpers.hf_models:make_gpt2"``); ``data_<name>(path)`` writes a matching named-input
``.safetensors`` data set. Shapes: N rows, T tokens, image 3 x 16 x 16, 3 classes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
from safetensors.torch import save_file
from torch import nn

from tests.conftest import small_job

VOCAB, T, ROWS, CLASSES = 48, 8, 64, 3


def make_gpt2(spec: Any, **args: Any) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    # No dropout: its masks come from each rank's RNG, so no layout could match (docs/models.md).
    cfg = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=T)
    cfg.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg.update(args)
    return GPT2LMHeadModel(GPT2Config(**cfg, bos_token_id=0, eos_token_id=0))


def make_llama(spec: Any, **args: Any) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=T,
    )
    cfg.update(args)
    return LlamaForCausalLM(LlamaConfig(**cfg, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def _bert_config(vocab: int, positions: int, **args: Any) -> Any:
    """A tiny BERT's config without dropout (its masks come from each rank's RNG)."""
    from transformers import BertConfig

    cfg: dict[str, Any] = dict(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        vocab_size=vocab,
        max_position_embeddings=positions,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    cfg.update(args)
    return BertConfig(**cfg)


def make_bert(spec: Any, **args: Any) -> nn.Module:
    from transformers import BertForSequenceClassification

    return BertForSequenceClassification(_bert_config(VOCAB, T, num_labels=CLASSES, **args))


def make_bert_mlm(spec: Any, **args: Any) -> nn.Module:
    """A masked language model over the data's own vocabulary and context (spec)."""
    from transformers import BertForMaskedLM

    return BertForMaskedLM(_bert_config(spec.vocab_size, spec.input_shape[0], **args))


def make_bert_classifier(spec: Any, **args: Any) -> nn.Module:
    """A sequence classifier over the data's vocabulary, context and classes (spec)."""
    from transformers import BertForSequenceClassification

    config = _bert_config(spec.vocab_size, spec.input_shape[0], num_labels=spec.num_outputs, **args)
    return BertForSequenceClassification(config)


def make_resnet(spec: Any, **args: Any) -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = dict(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=CLASSES
    )
    cfg.update(args)
    return ResNetForImageClassification(ResNetConfig(**cfg))


def make_vit(spec: Any, **args: Any) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = dict(
        image_size=16,
        patch_size=8,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=CLASSES,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    cfg.update(args)
    return ViTForImageClassification(ViTConfig(**cfg))


def write_data(name: str, path: Path) -> Path:
    """A named-input data set for model ``name`` (integer ids stay int64)."""
    g = torch.Generator().manual_seed(0)
    if name in ("gpt2", "llama"):
        stream = torch.randint(0, VOCAB, (ROWS, T + 1), generator=g)
        tensors = {"input_ids": stream[:, :-1].contiguous(), "targets": stream[:, 1:].contiguous()}
    elif name == "bert":
        mask = torch.ones(ROWS, T, dtype=torch.int64)
        mask[::2, T // 2 :] = 0  # half the rows padded: the mask matters
        tensors = {
            "input_ids": torch.randint(0, VOCAB, (ROWS, T), generator=g),
            "attention_mask": mask,
            "targets": torch.randint(0, CLASSES, (ROWS,), generator=g),
        }
    else:
        tensors = {
            "pixel_values": torch.randn(ROWS, 3, 16, 16, generator=g),
            "targets": torch.randint(0, CLASSES, (ROWS,), generator=g),
        }
    save_file(tensors, str(path))
    return path


def hf_job(name: str, source: Path | None, world: int = 1, **sections: dict[str, Any]) -> Any:
    """A short AdamW job of ``make_<name>`` on ``source`` (None: the job's default) over
    ``world`` processes; ``sections`` update the job's sections (``model={"block_size": 12}``)."""
    base: dict[str, Any] = {
        "model": {"name": f"tests.helpers.hf_models:make_{name}"},
        "data": {} if source is None else {"source": str(source)},
        "train": {"steps": 3, "global_batch_size": 8},
        "optim": {"name": "adamw", "lr": 1e-3},
        "launch": {"nproc": world},
    }
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    return small_job(**base)

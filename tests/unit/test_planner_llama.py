"""The planner on a transformers Llama (GQA, SwiGLU, RMSNorm), the model family users train most:
its statistics counted on the meta device as the run holds them (fused attention's saved
tensors, the job's dtype) and per layer, and its memory on the layouts published runs used."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from polytrain.config.io import job_from_dict
from polytrain.config.job import JobConfig
from polytrain.measure.stats import model_stats

TEXT = "the quick brown fox jumps over the lazy dog. " * 400
_LLAMA = "tests.helpers.hf_models:make_llama"
# a tiny Llama whose attention scores (T x T per head) outweigh the rest of a layer's saves
TINY = dict(
    num_hidden_layers=3,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
)


def llama_job(tmp_path: Path, seq: int = 256, dtype: str = "fp32", **args: Any) -> JobConfig:
    """A job of `make_llama` over a byte-tokenized corpus in windows of ``seq`` tokens."""
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return job_from_dict(
        {
            "model": {
                "name": _LLAMA,
                "args": {**TINY, "max_position_embeddings": seq, **args},
                "block_size": seq,
            },
            "data": {"source": str(path), "tokenizer": "byte"},
            "train": {"global_batch_size": 8, "dtype": dtype},
        }
    )


def test_meta_counts_attention_as_the_fused_kernel_saves_it(tmp_path: Path) -> None:
    """[Note: fused attention's saved tensors]: the meta device's math path would save the
    (T x T) scores of every head (here more than the rest of the layer); counted as the fused
    kernel keeps them, meta's saved bytes are the CPU run's within 10%, whole and per layer."""
    job = llama_job(tmp_path)
    meta = model_stats(job, imports=False)
    cpu = model_stats(job, device="cpu", imports=False)
    assert meta.blocks[0].saved_bytes == pytest.approx(cpu.blocks[0].saved_bytes, rel=0.10)
    for m, c in zip(meta.layer_blocks, cpu.layer_blocks, strict=True):
        assert m.saved_bytes == pytest.approx(c.saved_bytes, rel=0.10)

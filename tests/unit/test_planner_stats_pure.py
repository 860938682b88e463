"""The analytic statistics agree with the models they describe."""

from __future__ import annotations

import pytest
import torch

from polytrain.data.datasets import DataSpec
from polytrain.models import mlp
from polytrain.models.gpt import SIZES, GPTConfig, build_gpt
from polytrain.planner.stats_pure import MLP_EMBED_DIM, gpt_stats, mlp_stats


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_gpt_parameter_counts_per_block(size: str) -> None:
    dims = SIZES[size]
    with torch.device("meta"):
        model = build_gpt(GPTConfig(vocab_size=65, **dims))
    stats = gpt_stats(**dims, vocab_size=65)
    real = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    assert [b.params for b in stats.blocks] == real


def test_mlp_parameter_counts_per_block() -> None:
    assert MLP_EMBED_DIM == mlp.EMBED_DIM
    dims = mlp.SIZES["small"]
    spec = DataSpec(kind="tokens", vocab_size=65, input_shape=(dims["block_size"],))
    with torch.device("meta"):
        model = mlp.build_mlp(spec, dims["n_layer"], dims["n_embd"], dims["block_size"])
    stats = mlp_stats(**dims, vocab_size=65)
    real = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    assert [b.params for b in stats.blocks] == real


def test_gpt_attention_calls_match_the_counted_ones() -> None:
    """[Note: attention kernels]: the analytic stats record the same attention call (T, S, D,
    FLOPs per sample) and the same FLOPs inside it as `measure.stats` counts on meta."""
    from polytrain.config.job import JobConfig, ModelConfig
    from polytrain.measure.stats import model_stats

    dims = {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 16}
    counted = model_stats(JobConfig(model=ModelConfig(name="gpt", **dims)), device="meta")
    (block,) = [b for b in counted.blocks if b.attention]
    pure = gpt_stats(**dims, vocab_size=65).blocks[1]
    assert pure.attention == block.attention
    assert pure.attention_counted == pytest.approx(block.attention_counted)

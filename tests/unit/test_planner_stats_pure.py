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


def test_a_llama_layer_counts_gqa_swiglu_and_flash_attention() -> None:
    """Llama 3.1 8B (Meta's params.json): 8,030,261,248 parameters; the GPT defaults keep
    Korthikanti et al.'s eq. 1 (34 T C + 5 a T^2 bytes) and 24 T C^2 + 4 T^2 C FLOPs."""
    from polytrain.planner.stats_pure import transformer_stats

    T, C, F, V = 8192, 4096, 14336, 128256
    llama = transformer_stats(
        n_layer=32, n_embd=C, n_head=32, n_kv_head=8, ffn_hidden=F, gated=True, vocab_size=V,
        seq_len=T, bias=False, dropout=False, position_table=False, flash=True,
        act_bytes=2, param_bytes=2,
    )  # fmt: skip
    assert sum(b.params for b in llama.blocks) == 8_030_261_248
    layer = llama.blocks[1]
    linear = 2 * C * C + 2 * C * 1024 + 3 * C * F  # q, o; k, v of 8 heads of 128; gate, up, down
    assert layer.params == linear + 2 * C and layer.fwd_flops == 2 * T * linear + 4 * T * T * C
    # no T x T term (flash), no dropout masks: q/k/v input, q, k, v, projection input; MLP
    # input, gate, up, silu(gate), product; two norms' inputs
    assert layer.saved_bytes == 2 * T * C * 3 + 4 * T * 1024 + 2 * T * C + 8 * T * F + 4 * T * C
    assert llama.tp_divisor == 8
    assert sum(b for b, _ in layer.tp_shards) == layer.param_bytes

    gpt = transformer_stats(n_layer=2, n_embd=64, n_head=4, seq_len=32, vocab_size=100,
                            act_bytes=2, param_bytes=2)  # fmt: skip
    g = gpt.blocks[1]
    assert g.params == 12 * 64 * 64 + 13 * 64
    assert g.saved_bytes == 32 * 64 * (34 + 5 * 4 * 32 / 64)
    assert g.fwd_flops == 24 * 32 * 64 * 64 + 4 * 32 * 32 * 64
    assert g.saved_whole_bytes == 10 * 32 * 64
    assert sum(b for b, _ in g.tp_shards) == g.param_bytes

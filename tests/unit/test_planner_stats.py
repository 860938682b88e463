"""`measure.stats`: FLOPs and bytes per block of the built-in models, counted on meta and CPU."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from polytrain.config.job import DataConfig, JobConfig, ModelConfig, OptimConfig
from polytrain.data.datasets import PairDataset, TokenDataset, build_datasets
from polytrain.measure.stats import held_data_bytes, model_stats, optimizer_state_per_param
from polytrain.models.registry import block_size_of, build_model

TEXT = "the quick brown fox jumps over the lazy dog. " * 200


def _job(tmp_path: Path, name: str, **model: int) -> JobConfig:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return JobConfig(model=ModelConfig(name=name, **model), data=DataConfig(source=str(path)))


def _real_model(job: JobConfig) -> torch.nn.Module:
    _, _, spec = build_datasets(job.data, block_size_of(job.model))
    return build_model(job.model, spec, job.train.seed)


@pytest.mark.parametrize("name", ["gpt", "mlp"])
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_params_match_the_built_model(tmp_path: Path, name: str, device: str) -> None:
    job = _job(tmp_path, name)
    stats = model_stats(job, device=device)
    model = _real_model(job)
    assert stats.params == sum(p.numel() for p in model.parameters())
    assert stats.param_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    assert [b.params for b in stats.blocks] == [
        sum(p.numel() for p in block.parameters()) for block in model.blocks
    ]


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_gpt_flops_follow_two_flops_per_weight_per_token(tmp_path: Path, device: str) -> None:
    # Forward FLOPs ~ 2 x (weights that multiply) x tokens; attention scores add 4 x T x C per
    # layer per token, so a tiny GPT (T = 64, C = 128) lands within 10% of the rule.
    job = _job(tmp_path, "gpt")
    stats = model_stats(job, device=device)
    matmul_params = stats.params - stats.blocks[0].params  # embeddings are lookups
    rule = 2 * matmul_params * stats.tokens_per_sample
    assert stats.fwd_flops == pytest.approx(rule, rel=0.10)
    assert stats.blocks[0].fwd_flops == 0  # the embedding block does no matmul


def test_mlp_flops_are_two_per_weight_per_sample(tmp_path: Path) -> None:
    # The MLP reads a whole window as one input vector: one multiply-add per weight per sample;
    # biases and GELU are below 2%.
    stats = model_stats(_job(tmp_path, "mlp"))
    matmul_params = stats.params - stats.blocks[0].params
    assert stats.fwd_flops == pytest.approx(2 * matmul_params, rel=0.02)


def test_saved_activations_scale_with_context_and_exclude_weights(tmp_path: Path) -> None:
    short = model_stats(_job(tmp_path, "gpt", block_size=32), device="cpu")
    long = model_stats(_job(tmp_path, "gpt", block_size=64), device="cpu")
    # A transformer block saves O(T x C) per sample on CPU's fused attention: doubling T
    # doubles it; the weights (same in both) are not counted.
    assert long.blocks[1].saved_bytes == pytest.approx(2 * short.blocks[1].saved_bytes, rel=0.02)
    assert long.blocks[1].saved_bytes < long.blocks[1].param_bytes
    # The output of a transformer block is (T, C) floats per sample.
    assert long.blocks[1].output_bytes == 64 * 128 * 4


def test_meta_counts_without_allocating_a_large_model(tmp_path: Path) -> None:
    # 24 layers x 2048 wide: about 1.2 B parameters, 4.8 GB in fp32; meta holds none of it.
    job = _job(tmp_path, "gpt", n_layer=24, n_embd=2048, n_head=16, block_size=64)
    stats = model_stats(job)
    assert stats.params > 1_200_000_000
    assert stats.param_bytes == 4 * stats.params


def test_measure_times_every_block(tmp_path: Path) -> None:
    stats = model_stats(_job(tmp_path, "mlp"), measure=True, batch=4, repeats=2)
    for block in stats.blocks:
        assert block.fwd_s is not None and block.fwd_s > 0
        assert block.bwd_s is not None and block.bwd_s > 0


def test_optimizer_state_per_param() -> None:
    assert optimizer_state_per_param(JobConfig()) == 2
    assert optimizer_state_per_param(JobConfig(optim=OptimConfig(name="sgd"))) == 0
    assert optimizer_state_per_param(JobConfig(optim=OptimConfig(name="sgd", momentum=0.9))) == 1


def test_linear_shapes_and_rows_when_the_cost_model_asks(tmp_path: Path) -> None:
    stats = model_stats(_job(tmp_path, "gpt"))
    block = stats.blocks[1]
    assert block.linears == ((128, 128),) * 4 + ((128, 512), (512, 128))  # type: ignore[attr-defined]
    assert block.rows_per_sample == 64  # type: ignore[attr-defined]
    assert stats.tp_divisor == 4  # type: ignore[attr-defined]


def test_tensor_parallel_shards_follow_the_runtime_plan(tmp_path: Path) -> None:
    """[Note: tensor-parallel shards] from `resolve_tp_plan` agree with the analytic split of
    `stats_pure` (LayerNorms, row-parallel biases and the position table whole), cover every
    byte, and the vocabulary rows drop out when tp does not divide the vocabulary."""
    from polytrain.planner.stats_pure import gpt_stats

    job = _job(tmp_path, "gpt", n_layer=2, n_embd=32, n_head=4, block_size=16)
    stats = model_stats(job, device="meta")
    vocab = stats.blocks[0].params // 32 - 16
    pure = gpt_stats(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=vocab)
    for block, analytic in zip(stats.blocks, pure.blocks, strict=True):
        assert sum(b for b, _ in block.tp_shards) == block.param_bytes
        assert block.tensors == analytic.tensors
        for tp in (2, 4):
            assert block.bytes_per_tp_rank(tp) == pytest.approx(analytic.bytes_per_tp_rank(tp))
    odd = next(t for t in range(2, vocab + 2) if vocab % t)  # a tp that misses the vocabulary
    assert stats.blocks[0].bytes_per_tp_rank(odd) == stats.blocks[0].param_bytes


def test_tensor_parallel_modules_and_their_activations_follow_the_runtime_plan(
    tmp_path: Path,
) -> None:
    """[Note: tensor-parallel modules]: each layer's q, k, v, fc column-parallel and both
    projections row-parallel, with their activations' bytes per sample; the vocabulary rows
    carry the vocabulary as divisor; a model without a plan has None."""
    job = _job(tmp_path, "gpt", n_layer=2, n_embd=32, n_head=4, block_size=16)
    stats = model_stats(job, device="meta")
    first, *layers, last = stats.blocks
    vocab = first.params // 32 - 16
    row = 16 * 32 * 4  # tokens x width x fp32 bytes
    for layer in layers:
        assert layer.tp_modules is not None
        assert [m.style for m in layer.tp_modules] == ["colwise"] * 3 + [
            "rowwise",
            "colwise",
            "rowwise",
        ]
        assert [m.in_bytes for m in layer.tp_modules] == [row] * 4 + [row, 4 * row]
        assert [m.out_bytes for m in layer.tp_modules] == [row] * 4 + [4 * row, row]
        assert sum(m.tensors for m in layer.tp_modules) == 12 and layer.tensors == 16
        assert len(layer.tp_applied(2)) == 6 and layer.tp_applied(1) == ()
    (embed,) = first.tp_modules or ()
    assert (embed.style, embed.divisor, embed.in_bytes, embed.out_bytes) == (
        "vocab",
        vocab,
        0.0,
        row,
    )
    (head,) = last.tp_modules or ()
    assert (head.style, head.divisor, head.in_bytes) == ("colwise_gather", vocab, row)
    odd = next(t for t in range(2, vocab + 2) if vocab % t)
    assert first.tp_applied(odd) == ()


def test_operator_counts_cover_forward_and_backward(tmp_path: Path) -> None:
    """[Note: non-matmul time]: every block calls operators both ways; the count does not grow
    with the batch, the moved bytes are per sample, and matmuls move none."""
    from polytrain.measure.stats import OpCounter

    stats = model_stats(_job(tmp_path, "mlp"), device="meta")
    assert all(b.fwd_ops > 0 and b.bwd_ops > 0 for b in stats.blocks)
    assert all(b.fwd_moved_bytes > 0 for b in stats.blocks)
    lin = torch.nn.Linear(8, 8, bias=False).to("meta")
    x = torch.ones(4, 8, device="meta")
    with OpCounter() as counter:
        lin(x)
    assert counter.ops == 2 and counter.moved == 0.0  # t (a view) and mm


def test_data_bytes_are_the_data_sets_storages_each_once(tmp_path: Path) -> None:
    """[Note: a worker's own memory]: every worker holds the whole token stream (int64 per
    character for the char tokenizer); the validation split is a view of the same storage."""
    stats = model_stats(_job(tmp_path, "mlp"))
    assert stats.data_bytes == len(TEXT) * 8
    tokens = torch.arange(100)
    assert held_data_bytes(TokenDataset(tokens[:80], 8), TokenDataset(tokens[80:], 8)) == 800
    x, y = torch.zeros(10, 3), torch.zeros(10, dtype=torch.long)
    named = PairDataset({"a": x, "b": x[:, :1]}, y)
    assert held_data_bytes(PairDataset(x, y), named) == 10 * 3 * 4 + 10 * 8


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_tensor_parallel_splits_saved_tensors_from_column_to_row_parallel(
    tmp_path: Path, device: str
) -> None:
    """[Note: tensor-parallel activations] gpt tiny (T = 64, C = 128) under `gpt_plan`: a layer
    keeps whole its two layer norms' inputs and outputs (4 T C floats: the residual stream and
    the column-parallel layers' inputs) and their means and reciprocal deviations (4 T); q, k,
    v, the attention's output and the MLP's two 4C-wide activations (12 T C on CPU's fused
    attention) are split. The last block (final norm, gathered logits, loss) is all whole."""
    stats = model_stats(_job(tmp_path, "gpt"), device=device)
    t, c = 64, 128
    layer = stats.blocks[1]
    assert layer.saved_whole_bytes == (4 * t * c + 4 * t) * 4
    if device == "cpu":
        split = layer.saved_bytes - layer.saved_whole_bytes
        assert split == pytest.approx(12 * t * c * 4, rel=0.01)
    assert layer.saved_per_tp_rank(2) == pytest.approx(
        layer.saved_whole_bytes + (layer.saved_bytes - layer.saved_whole_bytes) / 2
    )
    assert stats.blocks[-1].saved_whole_bytes == stats.blocks[-1].saved_bytes


def test_bf16_counts_weight_copies_apart_from_the_per_sample_bytes(tmp_path: Path) -> None:
    """[Note: counted under autocast]: under bf16 autocast each Linear's weight is saved once
    per pass as a bf16 copy; the count splits it out (it does not scale with the batch) and the
    per-sample bytes fall below fp32's."""
    base = _job(tmp_path, "gpt", n_layer=2, n_embd=64, n_head=4, block_size=32)
    fp32 = model_stats(base, device="cpu")
    bf16 = model_stats(_bf16(base), device="cpu")
    block = bf16.blocks[1]
    linear_weights = sum(fi * fo for fi, fo in block.linears)
    assert block.saved_fixed_bytes == pytest.approx(2 * linear_weights, rel=0.05)
    assert block.saved_bytes < fp32.blocks[1].saved_bytes
    assert all(b.saved_fixed_bytes == 0 for b in fp32.blocks)


def _bf16(job: JobConfig) -> JobConfig:
    return replace(job, train=replace(job.train, dtype="bf16"))

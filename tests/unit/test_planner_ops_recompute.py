"""Selective recomputation (``parallel.recompute = "ops"``) in the planner: what a block keeps
under the runtime's own policy (measure/ops_stats.py), and how layouts are priced with it
(planner/recompute.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from polytrain.config.job import DataConfig, JobConfig, ModelConfig
from polytrain.measure.stats import model_stats
from polytrain.planner.cluster import parse_cluster
from polytrain.planner.cost import Env, predict
from polytrain.planner.search import enumerate_layouts
from polytrain.planner.types import BlockStats, Layout, ModelStats
from tests.helpers.hf_models import hf_job, write_data

TEXT = "the quick brown fox jumps over the lazy dog. " * 200
OPS = Layout(dp=1, recompute=True, recompute_ops=True)


def _gpt(tmp_path: Path, dtype: str = "fp32") -> JobConfig:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    job = JobConfig(model=ModelConfig(name="gpt"), data=DataConfig(source=str(path)))
    return replace(job, train=replace(job.train, dtype=dtype))


def _between_full_and_none(blocks: tuple[BlockStats, ...]) -> None:
    """Every layer keeps more than its input (full recomputation) and less than all it saves
    (none); its backward rebuilds the rest, and it reruns operators but no matmul."""
    for b in blocks:
        assert b.ops_kept_bytes is not None, b.name
        assert b.output_bytes < b.ops_kept_bytes < b.saved_bytes, b.name
        assert 0 < b.ops_rebuilt_bytes < b.saved_bytes, b.name
        assert 0 < b.ops_rerun_ops < b.fwd_ops and b.ops_rerun_flops < 0.01 * b.fwd_flops


@pytest.mark.parametrize(("device", "dtype"), [("meta", "fp32"), ("cpu", "fp32"), ("meta", "bf16")])
def test_a_gpt_layer_keeps_between_its_input_and_all_it_saves(
    tmp_path: Path, device: str, dtype: str
) -> None:
    stats = model_stats(_gpt(tmp_path, dtype), device=device)
    layers = stats.blocks[1:-1]  # between the embedding and the head
    _between_full_and_none(layers)
    # fp32, C = 128, T = 64: the input, q k v, attention's output (and its log-sum-exp), the
    # projection, fc1 (4 C) and fc2: 11 C per token, of the 16 C it saves
    if dtype == "fp32":
        per_c = 64 * 128 * 4
        assert layers[0].ops_kept_bytes == pytest.approx(11 * per_c, rel=0.02)


def test_meta_and_cpu_count_the_same_kept_bytes(tmp_path: Path) -> None:
    # attention on meta is counted as the fused kernel keeps it, not as its math path's scores
    meta, cpu = (model_stats(_gpt(tmp_path), device=d) for d in ("meta", "cpu"))
    for a, b in zip(meta.blocks, cpu.blocks, strict=True):
        assert a.ops_kept_bytes == pytest.approx(b.ops_kept_bytes, rel=0.01), a.name


def test_a_transformers_gpt2_layer_keeps_between_its_input_and_all_it_saves(
    tmp_path: Path,
) -> None:
    data = write_data("gpt2", tmp_path / "gpt2.safetensors")
    job = hf_job("gpt2", data, model={"args": {"n_layer": 3}})
    stats = model_stats(job, imports=False)
    assert len(stats.layer_blocks) == 3
    _between_full_and_none(stats.layer_blocks[1:2])  # the middle layer: no embedding, no head
    assert stats.blocks[0].ops_kept_bytes is not None  # the one block the trainer sees


def test_ops_is_priced_between_none_and_full(tmp_path: Path) -> None:
    stats = model_stats(_gpt(tmp_path))
    env = Env(parse_cluster("1x1xcpu"))
    priced = {
        name: predict(layout, stats, env, 8)
        for name, layout in (
            ("none", Layout()),
            ("ops", OPS),
            ("full", replace(OPS, recompute_ops=False)),
        )
    }
    act = {k: p.breakdown["memory_activations"] for k, p in priced.items()}
    assert act["full"] < act["ops"] < act["none"]
    steps = {k: p.step_s for k, p in priced.items()}
    assert steps["none"] < steps["ops"] < steps["full"]
    assert OPS.describe() == "dp1-recompute-ops"
    assert OPS.overrides()["parallel.recompute"] == "ops"


def test_statistics_without_ops_counts_price_ops_as_keeping_everything(tmp_path: Path) -> None:
    stats = model_stats(_gpt(tmp_path))
    old = replace(stats, blocks=tuple(replace(b, ops_kept_bytes=None) for b in stats.blocks))
    env = Env(parse_cluster("1x1xcpu"))
    plain, ops = predict(Layout(), old, env, 8), predict(OPS, old, env, 8)
    assert ops.memory_per_rank == plain.memory_per_rank
    # and the search does not offer what it cannot price
    assert not any(
        lay.recompute_ops for lay in enumerate_layouts(1, old, parse_cluster("1x1xcpu"), 8)
    )


def test_the_search_tries_ops_after_every_second_block_and_before_full(tmp_path: Path) -> None:
    stats: ModelStats = model_stats(_gpt(tmp_path))
    found = [lay for lay in enumerate_layouts(1, stats, parse_cluster("1x1xcpu"), 8)]
    kinds = [(lay.recompute, lay.recompute_every, lay.recompute_ops) for lay in found]
    assert kinds == [(False, 1, False), (True, 2, False), (True, 1, True), (True, 1, False)]

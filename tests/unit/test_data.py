"""Data: the default corpus, the split, and the layout-invariant sampler (contract 1)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from polytrain.config import DataConfig
from polytrain.data import Batches, GlobalBatchSampler, build_datasets, default_corpus
from polytrain.errors import ConfigError


def test_default_corpus_is_stable() -> None:
    text = default_corpus()
    assert len(text) > 100_000
    assert text == default_corpus()


def test_split_is_fixed_and_disjoint() -> None:
    train, val, spec = build_datasets(DataConfig(), block_size=8)
    assert spec.kind == "tokens" and spec.vocab_size > 50
    assert len(train) > 8 * len(val)
    assert not torch.equal(train.tokens[-100:], val.tokens[:100])


def test_sampler_depends_on_seed_and_step_only() -> None:
    a = GlobalBatchSampler(1000, 16, seed=3)
    b = GlobalBatchSampler(1000, 16, seed=3)
    assert torch.equal(a.indices(5), b.indices(5))
    assert not torch.equal(a.indices(5), a.indices(6))
    assert not torch.equal(a.indices(5), GlobalBatchSampler(1000, 16, seed=4).indices(5))


@pytest.mark.parametrize(("replicas", "micro"), [(1, 1), (2, 1), (2, 2), (4, 2), (1, 8)])
def test_replica_and_microbatch_slices_tile_the_global_batch(replicas: int, micro: int) -> None:
    sampler = GlobalBatchSampler(1000, 16, seed=0)
    parts = [sampler.shard(7, r, replicas, m, micro) for r in range(replicas) for m in range(micro)]
    assert torch.equal(torch.cat(parts), sampler.indices(7))


def test_batches_are_next_token_windows() -> None:
    train, val, _ = build_datasets(DataConfig(), block_size=8)
    x, y = Batches(train, val, 4, 0).train(0)
    assert x.shape == y.shape == (4, 8)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_text_npy_and_safetensors_sources(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("hello world, " * 100)
    _, _, spec = build_datasets(DataConfig(source=str(text)), 8)
    assert spec.decode([0]) in "hello world, "
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.arange(500) % 7)
    _, _, spec = build_datasets(DataConfig(source=str(tokens)), 8)
    assert spec.vocab_size == 7
    pairs = tmp_path / "pairs.safetensors"
    save_file({"inputs": torch.randn(100, 5), "targets": torch.randint(0, 3, (100,))}, str(pairs))
    train, val, spec = build_datasets(DataConfig(source=str(pairs)), 8)
    assert spec.kind == "pairs" and spec.num_outputs == 3 and spec.input_shape == (5,)
    assert len(train) + len(val) == 100


def test_bad_sources(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        build_datasets(DataConfig(source=str(tmp_path / "missing.txt")), 8)
    bad = tmp_path / "bad.safetensors"
    save_file({"x": torch.zeros(3)}, str(bad))
    with pytest.raises(ConfigError, match="expected 'targets' and either 'inputs'"):
        build_datasets(DataConfig(source=str(bad)), 8)
    floats = tmp_path / "floats.npy"
    np.save(floats, np.zeros((3, 3)))
    with pytest.raises(ConfigError, match="1-D integer token array"):
        build_datasets(DataConfig(source=str(floats)), 8)

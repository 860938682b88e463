"""Models are block sequences with layout-independent initial weights; the LR schedule."""

from __future__ import annotations

import math

import pytest
import torch

from polytrain.config import DataConfig, ModelConfig, OptimConfig
from polytrain.core.optim import lr_at
from polytrain.data import build_datasets
from polytrain.errors import ConfigError
from polytrain.models import build_model


@pytest.fixture(scope="module")
def spec():  # type: ignore[no-untyped-def]
    return build_datasets(DataConfig(), 16)[2]


def test_same_seed_same_weights(spec) -> None:  # type: ignore[no-untyped-def]
    a = build_model(ModelConfig(name="gpt", size="tiny", block_size=16), spec, seed=3)
    b = build_model(ModelConfig(name="gpt", size="tiny", block_size=16), spec, seed=3)
    c = build_model(ModelConfig(name="gpt", size="tiny", block_size=16), spec, seed=4)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    assert any(not torch.equal(p, r) for p, r in zip(a.parameters(), c.parameters(), strict=True))


def test_building_does_not_consume_global_rng(spec) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    build_model(ModelConfig(name="mlp"), spec, seed=1)
    assert torch.equal(torch.rand(3), expected)


def test_gpt_blocks_and_names(spec) -> None:  # type: ignore[no-untyped-def]
    model = build_model(ModelConfig(name="gpt", n_layer=3, block_size=16), spec, seed=0)
    assert model.num_blocks == 5  # embedding, 3 blocks, head
    assert all(name.startswith("blocks.") for name, _ in model.named_parameters())
    x = torch.randint(0, spec.vocab_size, (2, 16))
    assert model(x).shape == (2, 16, spec.vocab_size)


def test_heads_must_divide_width(spec) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="not divisible by model.n_head"):
        build_model(ModelConfig(name="gpt", n_embd=30, n_head=4), spec, seed=0)


def test_unknown_model_and_bad_factory(spec) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="not a built-in model"):
        build_model(ModelConfig(name="alexnet"), spec, seed=0)
    with pytest.raises(ConfigError, match="cannot import module"):
        build_model(ModelConfig(name="no_such_pkg.mod:make"), spec, seed=0)
    with pytest.raises(ConfigError, match="has no callable"):
        build_model(ModelConfig(name="math:no_such_fn"), spec, seed=0)


def test_warmup_then_cosine() -> None:
    cfg = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg, 100) == pytest.approx(0.1)
    assert lr_at(9, cfg, 100) == pytest.approx(1.0)
    assert lr_at(99, cfg, 100) == pytest.approx(0.1, abs=1e-3)
    mid = lr_at(55, cfg, 100)
    assert mid == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)), rel=1e-6)
    assert lr_at(50, OptimConfig(lr=0.3, schedule="constant"), 100) == 0.3

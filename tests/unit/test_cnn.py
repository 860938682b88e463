"""The image models (cnn, resnet), the digits data set, .npz images and top-1 accuracy, in
process: shapes, blocks, sizes, splits and the one-line errors for images a model cannot read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from polytrain.config.job import DataConfig, ModelConfig
from polytrain.core.tensor_parallel import resolve_tp_plan
from polytrain.data.datasets import Dataset, DataSpec, build_datasets
from polytrain.errors import ConfigError
from polytrain.models.base import BlockModel
from polytrain.models.checks import has_batchnorm
from polytrain.models.contract import top1_correct
from polytrain.models.registry import build_model
from polytrain.parallel.hybrid import resolve_hybrid_plan
from polytrain.parallel.spatial import check_spatial

pytest.importorskip("sklearn")


def digits() -> tuple[Dataset, Dataset, DataSpec]:
    return build_datasets(DataConfig(source="digits"), 1)


def test_digits_split_is_fixed_disjoint_and_scaled() -> None:
    train, val, spec = digits()
    _, again_val, _ = build_datasets(DataConfig(source="digits"), 1)
    assert (len(train), len(val)) == (1617, 180)
    assert spec.input_shape == (1, 8, 8) and spec.num_outputs == 10 and spec.classification
    x, y = val.get(torch.arange(180))
    x2, y2 = again_val.get(torch.arange(180))
    assert torch.equal(x, x2) and torch.equal(y, y2)  # the same split every time
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    assert len(set(y.tolist())) == 10  # shuffled: every class is in the validation set
    xt, _ = train.get(torch.arange(1617))
    flat_val = {tuple(r.flatten().tolist()) for r in x}
    overlap = sum(tuple(r.flatten().tolist()) in flat_val for r in xt)
    assert overlap < 5  # the data set holds a handful of duplicate images, no shared rows


@pytest.mark.parametrize(("name", "blocks"), [("cnn", 6), ("resnet", 4)])
def test_image_models_are_block_sequences(name: str, blocks: int) -> None:
    train, _, spec = digits()
    model = build_model(ModelConfig(name=name), spec, seed=3)
    again = build_model(ModelConfig(name=name), spec, seed=3)
    assert model.num_blocks == blocks
    x, y = train.get(torch.arange(5))
    out = model(x)
    assert out.shape == (5, 10)
    assert torch.equal(out, again(x))  # weights depend on the seed only
    loss = model.loss(out, y)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert has_batchnorm(model) == (name == "resnet")


def test_sizes_and_fields_scale_the_models() -> None:
    _, _, spec = digits()

    def numel(**fields: object) -> int:
        m = build_model(ModelConfig(**fields), spec, 0)
        return sum(p.numel() for p in m.parameters())

    assert numel(name="cnn") < numel(name="cnn", size="small") < numel(name="cnn", size="medium")
    assert numel(name="cnn", n_embd=512) > numel(name="cnn")
    assert build_model(ModelConfig(name="cnn", n_layer=5), spec, 0).num_blocks == 8
    assert build_model(ModelConfig(name="resnet", n_layer=3), spec, 0).num_blocks == 5
    assert numel(name="resnet", n_embd=32) > numel(name="resnet")


def test_cnn_fully_connected_layers_dominate_parameters_and_take_the_tp_plan() -> None:
    """AlexNet's shape, which hybrid parallelism relies on; the built-in tp plan splits the
    Linear layers and leaves the convolutions replicated."""
    _, _, spec = digits()
    model = build_model(ModelConfig(name="cnn"), spec, 0)
    conv = sum(p.numel() for n, p in model.named_parameters() if ".conv." in n)
    fc = sum(p.numel() for n, p in model.named_parameters() if ".fc." in n or ".out." in n)
    assert fc > 10 * conv
    plan = resolve_tp_plan("cnn", model, 2, [])
    assert plan == {
        "blocks.3.fc": "colwise",
        "blocks.4.fc": "rowwise",
        "blocks.5.out": "colwise_gather",
    }


def test_large_images_pool_to_a_fixed_width() -> None:
    spec = DataSpec(kind="pairs", input_shape=(3, 40, 56), num_outputs=4)
    model = build_model(ModelConfig(name="cnn"), spec, 0)
    assert model(torch.rand(2, 3, 40, 56)).shape == (2, 4)
    resnet = build_model(ModelConfig(name="resnet"), spec, 0)
    assert resnet(torch.rand(2, 3, 40, 56)).shape == (2, 4)
    grey = build_model(
        ModelConfig(name="cnn"), DataSpec(kind="pairs", input_shape=(8, 8), num_outputs=2), 0
    )
    assert grey(torch.rand(2, 8, 8)).shape[0] == 2  # (H, W) rows are one channel


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (DataSpec(kind="tokens", vocab_size=10, input_shape=(16,)), "needs images"),
        (DataSpec(kind="pairs", input_shape=(32, 32, 3), num_outputs=2), "channels-last"),
        (DataSpec(kind="pairs", input_shape=(12,), num_outputs=2), "needs images"),
        (DataSpec(kind="pairs", input_shape=(1, 8, 8), classification=False), "integer class"),
    ],
    ids=["tokens", "channels-last", "flat rows", "float targets"],
)
def test_images_the_models_cannot_read_are_one_line(spec: DataSpec, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        build_model(ModelConfig(name="cnn"), spec, 0)
    assert "\n" not in str(info.value)


def test_npz_images_load_without_pickle(tmp_path: Path) -> None:
    images = np.random.default_rng(0).integers(0, 255, (20, 3, 6, 6), dtype=np.uint8)
    labels = np.arange(20) % 4
    path = tmp_path / "images.npz"
    np.savez(path, inputs=images, targets=labels)
    train, val, spec = build_datasets(DataConfig(source=str(path), val_fraction=0.25), 1)
    assert spec.input_shape == (3, 6, 6) and spec.num_outputs == 4
    assert (len(train), len(val)) == (15, 5)
    x, y = val.get(torch.arange(5))
    assert torch.equal(x, torch.from_numpy(images[15:]).long())
    assert y.dtype == torch.int64
    model = build_model(ModelConfig(name="cnn"), spec, 0)
    assert model(x).shape == (5, 4)  # integer pixels are read as float values
    bad = tmp_path / "objects.npz"
    np.savez(bad, inputs=np.array([{"a": 1}] * 2, dtype=object), targets=np.arange(2))
    with pytest.raises(ConfigError, match="not a readable numeric .npz"):
        build_datasets(DataConfig(source=str(bad)), 1)


def test_npy_images_load_with_their_labels_beside_them(tmp_path: Path) -> None:
    images = np.random.default_rng(1).random((12, 1, 8, 8), dtype=np.float32)
    path = tmp_path / "photos.npy"
    np.save(path, images)
    with pytest.raises(ConfigError, match="photos.targets.npy") as info:  # no labels yet
        build_datasets(DataConfig(source=str(path)), 1)
    assert "\n" not in str(info.value)
    np.save(tmp_path / "photos.targets.npy", np.arange(12) % 3)
    train, val, spec = build_datasets(DataConfig(source=str(path), val_fraction=0.25), 1)
    assert len(val) == 3 and spec.input_shape == (1, 8, 8) and spec.num_outputs == 3
    x, y = train.get(torch.arange(9))
    assert torch.equal(x, torch.from_numpy(images[:9])) and y.dtype == torch.int64
    np.save(tmp_path / "photos.targets.npy", np.array(["a"] * 12, dtype=object))
    with pytest.raises(ConfigError, match="photos.targets.npy is not a readable numeric"):
        build_datasets(DataConfig(source=str(path)), 1)


def test_top1_counts_correct_rows_of_class_scores_only() -> None:
    scores = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    assert float(top1_correct(scores, torch.tensor([1, 1, 1]))) == 2.0
    assert top1_correct(scores, torch.tensor([1.0, 0.0, 1.0])) is None  # regression
    assert top1_correct(torch.zeros(2, 5, 7), torch.zeros(2, 5, dtype=torch.long)) is None


def test_hybrid_auto_splits_the_wide_layers_and_keeps_convolutions_data_parallel() -> None:
    """PAI's per-layer rule on AlexNet's shape: weights against moved activations."""
    _, _, spec = digits()
    model = build_model(ModelConfig(name="cnn"), spec, 0)
    plan = resolve_hybrid_plan(model, ["auto"], ranks=2, global_batch=32)
    assert plan == {"blocks.3.fc": "colwise", "blocks.4.fc": "rowwise"}
    # a batch so large that moving activations costs more than the weights: nothing to split
    with pytest.raises(ConfigError, match="found no Linear layer"):
        resolve_hybrid_plan(model, ["auto"], ranks=2, global_batch=4096)
    # the classifier (10 outputs) does not divide over 4 ranks; an odd run ends gathered
    wide = build_model(ModelConfig(name="cnn", n_embd=64), spec, 0)
    assert resolve_hybrid_plan(wide, ["auto"], ranks=4, global_batch=16) == {
        "blocks.3.fc": "colwise",
        "blocks.4.fc": "rowwise",
    }
    rows = ["blocks.3.fc=colwise", "blocks.4.fc=rowwise", "blocks.5.out=colwise_gather"]
    assert list(resolve_hybrid_plan(model, rows, ranks=2, global_batch=32)) == [
        "blocks.3.fc",
        "blocks.4.fc",
        "blocks.5.out",
    ]


def test_spatial_checks_every_band_before_launch() -> None:
    """The built-ins split at 2 and 4 on the digits; padding that shrinks the map, a split
    taller than the image and a user model without leading convolutions are one line each."""
    _, _, spec = digits()
    for name in ("cnn", "resnet"):
        with torch.device("meta"):
            model = build_model(ModelConfig(name=name), spec, 0)
        check_spatial(model, (1, 8, 8), 2)
        check_spatial(model, (1, 8, 8), 4)
        with pytest.raises(ConfigError, match="larger than the image height 8"):
            check_spatial(model, (1, 8, 8), 16)
    valid = BlockModel([nn.Conv2d(1, 4, 3, padding=0), nn.Flatten(), nn.Linear(144, 2)])
    with pytest.raises(ConfigError, match="turns 8 rows into 6"):
        check_spatial(valid, (1, 8, 8), 2)
    with pytest.raises(ConfigError, match="first blocks are convolutions"):
        check_spatial(BlockModel([nn.Flatten(), nn.Linear(64, 2)]), (1, 8, 8), 2)

"""Convolutional reference models for images: AlexNet-style (``cnn``) and a small ResNet.

``cnn`` follows Krizhevsky et al. (2012): convolutions (few parameters, most of the FLOPs),
then wide fully connected layers (most of the parameters, few FLOPs), the shape that PAI's
hybrid parallelism and Krizhevsky's "one weird trick" (2014) split differently.
``resnet`` follows He et al. (2016): a stem, residual basic blocks with BatchNorm, global
average pooling and a linear classifier.

Both are block sequences (`BlockModel`) so every strategy applies: one block per convolution
stage / residual block / fully connected layer. Widths come from the named size with
``model.n_layer`` (convolution stages or residual blocks) and ``model.n_embd`` (cnn: width of
the fully connected layers; resnet: channels of the stem) laid over it.

Shapes: B batch, C channels, H height, W width, F features, K classes.
Images are (B, C, H, W); rows of (H, W) are one channel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from polytrain.data.datasets import DataSpec
from polytrain.errors import ConfigError
from polytrain.models.base import BlockModel, LossFn
from polytrain.models.contract import resolve_loss

__all__ = ["CNN_SIZES", "RESNET_SIZES", "ImageDims", "build_cnn", "build_resnet", "image_dims"]

# channels: of the first convolution stage (cnn; doubled per stage up to 4x); block_size is
# unused by image models (kept so every built-in's dims have the same keys).
CNN_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 3, "n_embd": 256, "channels": 16, "block_size": 1},
    "small": {"n_layer": 4, "n_embd": 1024, "channels": 32, "block_size": 1},
    "medium": {"n_layer": 5, "n_embd": 4096, "channels": 64, "block_size": 1},
}
RESNET_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_embd": 16, "block_size": 1},
    "small": {"n_layer": 4, "n_embd": 32, "block_size": 1},
    "medium": {"n_layer": 8, "n_embd": 64, "block_size": 1},
}

# The first fully connected layer sees the last feature map pooled to POOLED x POOLED, so its
# width does not depend on the image size (AlexNet pools to 6 x 6).
POOLED = 4


@dataclass(frozen=True)
class ImageDims:
    channels: int
    height: int
    width: int


def image_dims(spec: DataSpec, model: str) -> ImageDims:
    """(C, H, W) of the data's images, or a one-line `ConfigError` saying what is wrong."""
    shape = spec.input_shape
    if spec.kind != "pairs" or spec.input_names or len(shape) not in (2, 3):
        got = "token data" if spec.kind == "tokens" else f"inputs of shape {shape}"
        raise ConfigError(
            f"model.name = {model!r} needs images, one tensor of rows (C, H, W) or (H, W) with "
            f"integer class targets, but the data gives {got}: use --data digits or a "
            ".safetensors / .npz file with 'inputs' (N, C, H, W) and 'targets' (N,)"
        )
    c, h, w = (1, *shape) if len(shape) == 2 else shape
    if c > 4 and w in (1, 3, 4):
        raise ConfigError(
            f"images of shape {shape} look channels-last (H, W, C) with {w} channel(s), and "
            f"model.name = {model!r} reads (C, H, W): store them as (N, {w}, {shape[0]}, "
            f"{shape[1]}) (numpy: images.transpose(0, 3, 1, 2))"
        )
    if not spec.classification:
        raise ConfigError(
            f"model.name = {model!r} is a classifier and the data's targets are floats: give "
            "integer class labels as targets"
        )
    return ImageDims(c, h, w)


def _as_image(x: torch.Tensor) -> torch.Tensor:
    """(B, H, W) -> (B, 1, H, W); integer pixels (uint8 images) as float values."""
    x = x if x.is_floating_point() else x.float()
    return x.unsqueeze(1) if x.dim() == 3 else x


class ConvStage(nn.Module):
    """Conv 3x3 (padding 1) -> ReLU -> max-pool 2x2 when ``pool``."""

    def __init__(self, c_in: int, c_out: int, pool: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.pool = nn.MaxPool2d(2) if pool else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(F.relu(self.conv(_as_image(x))))  # (B, C, H, W)


class Dense(nn.Module):
    """Fully connected layer -> ReLU -> dropout; the first one pools and flattens its input."""

    def __init__(self, fan_in: int, fan_out: int, dropout: float, flatten: bool) -> None:
        super().__init__()
        self.flatten = flatten
        self.fc = nn.Linear(fan_in, fan_out)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.flatten:  # (B, C, H, W) -> (B, C * POOLED * POOLED)
            x = F.adaptive_avg_pool2d(x, (POOLED, POOLED)).flatten(1)
        return self.drop(F.relu(self.fc(x)))  # (B, F)


class Classifier(nn.Module):
    def __init__(self, fan_in: int, num_classes: int, pool: bool = False) -> None:
        super().__init__()
        self.pool = pool
        self.out = nn.Linear(fan_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pool:  # global average pooling (ResNet): (B, C, H, W) -> (B, C)
            x = x.mean(dim=(2, 3))
        return self.out(x)  # (B, K)


def _loss(spec: DataSpec) -> LossFn:
    return resolve_loss("cross_entropy", spec.classification)


def build_cnn(
    spec: DataSpec, n_layer: int, fc_width: int, channels: int, dropout: float
) -> BlockModel:
    """AlexNet-style: ``n_layer`` conv stages (channels x1, x2, x4, x4, ...; 2x2 max-pooling
    while the map is at least 8 high), then two fully connected layers of ``fc_width`` and the
    classifier. Blocks: [ConvStage x n_layer, Dense, Dense, Classifier]."""
    dims = image_dims(spec, "cnn")
    blocks: list[nn.Module] = []
    c_in, height = dims.channels, min(dims.height, dims.width)
    for i in range(n_layer):
        c_out = channels * 2 ** min(i, 2)
        pool = height >= 8
        blocks.append(ConvStage(c_in, c_out, pool))
        c_in, height = c_out, height // 2 if pool else height
    blocks.append(Dense(c_in * POOLED * POOLED, fc_width, dropout, flatten=True))
    blocks.append(Dense(fc_width, fc_width, dropout, flatten=False))
    blocks.append(Classifier(fc_width, spec.num_outputs))
    return BlockModel(blocks, _loss(spec))


class Stem(nn.Module):
    """Conv 3x3 -> BatchNorm -> ReLU (a small image needs no 7x7 stride-2 stem)."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(_as_image(x))))


class BasicBlock(nn.Module):
    """He et al.'s basic block: two 3x3 convolutions with BatchNorm, plus the shortcut (a
    1x1 convolution with BatchNorm when the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def build_resnet(spec: DataSpec, n_layer: int, width: int) -> BlockModel:
    """[Stem, BasicBlock x n_layer, Classifier]. The blocks form up to 3 stages of equal
    length; each later stage halves the map (stride 2, while it is at least 4 high) and
    doubles the channels."""
    dims = image_dims(spec, "resnet")
    num_stages = min(3, n_layer)
    blocks: list[nn.Module] = [Stem(dims.channels, width)]
    c_in, height = width, min(dims.height, dims.width)
    for i in range(n_layer):
        stage = i * num_stages // n_layer
        first = i == 0 or stage != (i - 1) * num_stages // n_layer
        down = first and stage > 0 and height >= 4
        c_out = width * 2**stage
        blocks.append(BasicBlock(c_in, c_out, 2 if down else 1))
        c_in, height = c_out, height // 2 if down else height
    blocks.append(Classifier(c_in, spec.num_outputs, pool=True))
    return BlockModel(blocks, _loss(spec))

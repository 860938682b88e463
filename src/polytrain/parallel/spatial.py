"""Spatial parallelism: the rows of every image split over a group of ranks, halos exchanged.

Seed 000's spatial model parallelism for convolutions (Dryden et al., IPDPS 2019, "channel and
filter" and spatial decompositions; Mesh-TensorFlow's spatial split). Every rank of the group
holds the whole model and the same samples, but only its band of ``H / k`` image rows through
the model's leading convolution blocks: their activations (the large ones for a large image)
are divided by ``k``, up to the halo rows.

- Before each ``Conv2d`` the band gains P rows from the band above and K - S - P rows from the
  band below (`comm.halo`); the convolution then pads only the width. Its backward returns the
  halo rows' gradients to their owners. Borders, strides and padding come out exactly as one
  process computes them (checked in `check_spatial`: each band divisible by every stride).
- Pooling with kernel = stride and no padding, ReLU and the like act on a band alone;
  BatchNorm takes the statistics of all bands (`GlobalBatchNorm` over the group).
- Before the first block that is not spatial (it flattens, pools globally or holds a Linear
  layer) the bands are all-gathered into whole images; from there every rank runs the same
  computation. [Note: spatial gradient scale] As in hybrid parallelism, a rank's convolution
  gradient is its band's share of the true one, which is the sum over the bands: the gathered
  rows' gradient is multiplied by ``k`` and DDP's mean over the group becomes that sum, while
  the replicated tail's equal gradients are left as they are.

Shapes: B batch, C channels, H image height (h = H / k per band), W width.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from polytrain.comm.autograd import all_gather_rows
from polytrain.comm.halo import halo_rows
from polytrain.core.batchnorm import GlobalBatchNorm
from polytrain.errors import ConfigError
from polytrain.models.base import BlockModel

__all__ = ["BandConv2d", "apply_spatial", "check_spatial", "spatial_prefix"]

# Modules that act on a band of rows alone, or (convolutions, pooling) through `check_spatial`.
_LOCAL = (
    nn.BatchNorm2d,
    GlobalBatchNorm,
    nn.ReLU,
    nn.GELU,
    nn.SiLU,
    nn.Identity,
)
_POOLS = (nn.MaxPool2d, nn.AvgPool2d)


def _leaves(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    return ((n, m) for n, m in module.named_modules() if not any(True for _ in m.children()))


def spatial_prefix(model: BlockModel) -> int:
    """How many leading blocks run on bands: each made of convolutions, pooling and band-local
    layers only, with a convolution among them."""
    count = 0
    for block in model.blocks:
        leaves = [m for _, m in _leaves(block)]
        if not leaves or not all(isinstance(m, (nn.Conv2d, *_POOLS, *_LOCAL)) for m in leaves):
            break
        count += 1
    blocks = list(model.blocks)[:count]
    if not any(isinstance(m, nn.Conv2d) for b in blocks for m in b.modules()):
        return 0
    return count


def _input_heights(model: BlockModel, count: int, image: torch.Tensor) -> dict[str, int]:
    """Height of each convolution's / pooling's input over the whole image (meta device)."""
    heights: dict[str, int] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.Conv2d, *_POOLS)):

            def record(_: nn.Module, args: tuple[Any, ...], name: str = name) -> None:
                heights[name] = int(args[0].shape[2])

            hooks.append(module.register_forward_pre_hook(record))
    try:
        with torch.no_grad():
            x = image
            for block in list(model.blocks)[:count]:
                x = block(x)
    finally:
        for hook in hooks:
            hook.remove()
    return heights


def check_spatial(model: BlockModel, input_shape: tuple[int, ...], k: int) -> None:
    """Every band of every convolution and pooling input is a whole number of rows, divisible
    by its stride and at least its halo; a `ConfigError` naming the layer otherwise."""
    count = spatial_prefix(model)
    if count == 0:
        raise ConfigError(
            f"parallel.spatial = {k} needs a model whose first blocks are convolutions (cnn, "
            "resnet, or an nn.Sequential starting with Conv2d layers); this one has none"
        )
    if len(input_shape) not in (2, 3):
        raise ConfigError(
            f"parallel.spatial = {k} splits image rows, but the data's inputs have shape "
            f"{input_shape}: give images (C, H, W)"
        )
    height = input_shape[-2]
    if k > height:
        raise ConfigError(
            f"parallel.spatial = {k} is larger than the image height {height}: a band needs "
            f"at least one row; use at most {height} ranks"
        )
    shape = (1, *input_shape) if len(input_shape) == 3 else (1, 1, *input_shape)
    with torch.device("meta"):
        heights = _input_heights(model, count, torch.zeros(shape))
    for name, module in model.named_modules():
        if name not in heights:
            continue
        full = heights[name]
        kernel, stride, padding = _geometry(name, module)
        if (full + 2 * padding - kernel) // stride + 1 != full // stride:
            raise ConfigError(
                f"parallel.spatial = {k}: {name!r} (kernel {kernel}, stride {stride}, padding "
                f"{padding}) turns {full} rows into {(full + 2 * padding - kernel) // stride + 1}"
                f", not {full} / {stride}: spatial splits need padding that keeps the height up "
                f"to the stride (kernel - stride <= 2 x padding < kernel, e.g. padding "
                f"{kernel // 2} for kernel {kernel})"
            )
        band = full // k
        top, bottom = padding, kernel - stride - padding
        if full % k or band % stride or band < max(top, bottom):
            raise ConfigError(
                f"parallel.spatial = {k}: {name!r} (kernel {kernel}, stride {stride}, padding "
                f"{padding}) reads {full} rows, which do not split into {k} bands of equal "
                f"height divisible by {stride} and at least {max(top, bottom, 1)} rows: use a "
                f"spatial degree that divides the image height down to this layer, or larger "
                "images"
            )


def _geometry(name: str, module: nn.Module) -> tuple[int, int, int]:
    """(kernel, stride, padding) along the height; `ConfigError` for what bands cannot do."""
    if isinstance(module, nn.Conv2d):
        padding = module.padding
        if isinstance(padding, str) or module.dilation[0] != 1 or module.padding_mode != "zeros":
            raise ConfigError(
                f"parallel.spatial: convolution {name!r} uses padding {padding!r}, dilation "
                f"{module.dilation} or padding_mode {module.padding_mode!r}; spatial splits "
                "take integer zero padding and dilation 1"
            )
        return module.kernel_size[0], module.stride[0], padding[0]
    kernel, stride, pad = (_first(getattr(module, a)) for a in ("kernel_size", "stride", "padding"))
    if kernel != stride or pad != 0:
        raise ConfigError(
            f"parallel.spatial: pooling {name!r} has kernel {kernel}, stride {stride}, padding "
            f"{pad}; spatial splits take pooling with kernel = stride and no padding"
        )
    return kernel, stride, 0


def _first(value: Any) -> int:
    return int(value[0] if isinstance(value, tuple | list) else value)


def apply_spatial(model: BlockModel, halo_group: Any, group: Any, rank: int, k: int) -> int:
    """Make the leading convolution blocks run on this rank's band; returns how many blocks.

    ``halo_group``: a private group of the ``k`` ranks for the halo exchange; ``group``: the
    same ranks' data-parallel group (the gather; DDP and BatchNorm use it too)."""
    count = spatial_prefix(model)
    for block in list(model.blocks)[:count]:
        for module in block.modules():
            if isinstance(module, nn.Conv2d):
                _halo_conv(module, halo_group)

    def band(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        x = x.unsqueeze(1) if x.dim() == 3 else x  # (B, H, W) rows are one channel
        h = x.size(2) // k
        return (x[:, :, rank * h : (rank + 1) * h], *args[1:])

    def gather(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        # [Note: spatial gradient scale]
        return (all_gather_rows(args[0], group, grad_scale=float(k), dim=2), *args[1:])

    model.blocks[0].register_forward_pre_hook(band)
    if count < len(model.blocks):
        model.blocks[count].register_forward_pre_hook(gather)
    return count


class BandConv2d(nn.Conv2d):
    """A ``Conv2d`` on a band of rows (the same parameters; the class is swapped in place so
    names and state are unchanged). [Note: halo overlap] The exchange with the neighbouring
    bands is posted first; the output rows that read only this band's rows (the interior) are
    computed while it is in flight, and the few border rows once it has arrived. Neither the
    band nor the interior input is copied: autograd saves the band itself (which the layer
    before saved already) and two border slices of K rows."""

    halo_group: Any
    band_top: int  # P rows from the band above
    band_bottom: int  # K - S - P rows from the band below (< 0: the band's last rows unused)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """The convolution of rows that already carry their halo (zero padding: checked)."""
        return F.conv2d(
            x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, h, W) -> (B, C', h / S, W')
        k, s, p = self.kernel_size[0], self.stride[0], self.band_top
        h, bottom = x.size(2), self.band_bottom
        above, below, pending = halo_rows(x, p, max(bottom, 0), self.halo_group)
        n_out = h // s
        first = -(-p // s)  # the first output row whose input lies inside the band
        last = (h - k + p) // s  # the last one
        if first > last:  # a band thinner than the kernel: convolve the padded band
            pending.wait()
            full = torch.cat([above, x, below], dim=2)
            return self._rows(full[:, :, : full.size(2) + min(bottom, 0)])
        interior = self._rows(x[:, :, first * s - p : last * s - p + k])
        pending.wait()
        parts = []
        if first > 0:
            rows = torch.cat([above, x[:, :, : (first - 1) * s - p + k]], dim=2)
            parts.append(self._rows(rows))
        parts.append(interior)
        if last < n_out - 1:
            rows = torch.cat([x[:, :, (last + 1) * s - p :], below], dim=2)
            parts.append(self._rows(rows))
        return torch.cat(parts, dim=2) if len(parts) > 1 else interior


def _halo_conv(conv: nn.Conv2d, group: Any) -> None:
    """Make ``conv`` a `BandConv2d`: it pads only the width itself, the rows come from the
    neighbours."""
    padding = conv.padding
    assert not isinstance(padding, str)  # check_spatial refused it
    conv.__class__ = BandConv2d
    assert isinstance(conv, BandConv2d)
    conv.halo_group = group
    conv.band_top = padding[0]
    conv.band_bottom = conv.kernel_size[0] - conv.stride[0] - padding[0]
    conv.padding = (0, padding[1])

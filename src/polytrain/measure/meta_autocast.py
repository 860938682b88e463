"""Autocast on the meta device, which has none: the job's dtype in statistics counted there.

[Note: autocast on meta] A bf16 or fp16 job runs its forward under ``torch.autocast``
(`core.step.autocast`): matmul-class operators cast their floating inputs to the low dtype, save
those copies for backward and return low-precision outputs; a list of numerically sensitive
operators (softmax, norms, losses, exp, pow, sums) runs in fp32; everything else follows its
inputs' dtypes. The meta device has no autocast dispatch key, so a count there saw every tensor in
fp32: saved activations, pipeline payloads and tensor-parallel messages at twice a bf16 job's bytes.
`MetaAutocast` applies CUDA autocast's two operator lists (torch's "Autocast Op Reference",
``torch/csrc/autograd/autocast_mode.cpp``: ``lower_precision_fp`` and ``fp32``) at the Python
level, above autograd as autocast itself runs, so the casts are recorded and what autograd saves
is the cast copy, as in a run; a parameter is cast once per region, as autocast's weight cache
does. Operators are matched by name (``F.linear``, ``torch.matmul``, ``Tensor.softmax``), which
covers the functional, the ``torch`` and the method spelling of each. Checked against CPU
autocast on the same models (tests/unit/test_planner_llama.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["FP32_OPS", "LOWER_PRECISION_OPS", "MetaAutocast"]

LOWER_PRECISION_OPS = frozenset(
    {
        "__matmul__",
        "__rmatmul__",
        "addbmm",
        "addmm",
        "addmv",
        "addr",
        "baddbmm",
        "bmm",
        "chain_matmul",
        "multi_dot",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "linear",
        "matmul",
        "mm",
        "mv",
        "prelu",
        "scaled_dot_product_attention",
    }
)
FP32_OPS = frozenset(
    {
        "__pow__",
        "__rdiv__",
        "__rpow__",
        "__rtruediv__",
        "acos",
        "asin",
        "binary_cross_entropy_with_logits",
        "cosh",
        "cosine_embedding_loss",
        "cdist",
        "cosine_similarity",
        "cross_entropy",
        "cumprod",
        "cumsum",
        "dist",
        "erfinv",
        "exp",
        "expm1",
        "group_norm",
        "hinge_embedding_loss",
        "kl_div",
        "l1_loss",
        "layer_norm",
        "log",
        "log_softmax",
        "log10",
        "log1p",
        "log2",
        "margin_ranking_loss",
        "mse_loss",
        "multilabel_margin_loss",
        "multi_margin_loss",
        "nll_loss",
        "norm",
        "normalize",
        "pdist",
        "poisson_nll_loss",
        "pow",
        "prod",
        "reciprocal",
        "rsqrt",
        "sinh",
        "smooth_l1_loss",
        "soft_margin_loss",
        "softmax",
        "softmin",
        "softplus",
        "sum",
        "renorm",
        "tan",
        "triplet_margin_loss",
    }
)


class MetaAutocast(TorchFunctionMode):
    """[Note: autocast on meta] ``torch.autocast(dtype=low)`` for meta tensors."""

    def __init__(self, low: torch.dtype) -> None:
        super().__init__()
        self.low = low
        self._weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # autocast's cache

    def _cast(self, value: Any, dtype: torch.dtype) -> Any:
        if isinstance(value, list | tuple):
            return type(value)(self._cast(v, dtype) for v in value)
        if not (
            isinstance(value, torch.Tensor)
            and value.device.type == "meta"
            and value.is_floating_point()
            and value.dtype not in (dtype, torch.float64)
        ):
            return value
        if value.is_leaf and value.requires_grad:  # a parameter: cast once per region
            cached = self._weights.get(id(value))
            if cached is None or cached[0] is not value or cached[1].dtype != dtype:
                cached = (value, value.to(dtype))
                self._weights[id(value)] = cached
            return cached[1]
        return value.to(dtype)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        dtype = (
            self.low if name in LOWER_PRECISION_OPS else torch.float32 if name in FP32_OPS else None
        )
        if dtype is not None:
            args = self._cast(tuple(args), dtype)
            kwargs = {k: self._cast(v, dtype) for k, v in kwargs.items()}
        return func(*args, **kwargs)

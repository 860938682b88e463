"""Parity against a single-process reference: compare every tensor and name the one that differs.

The core correctness test of every synchronous strategy (ARCHITECTURE contract 1; torchgpipe's
``test_transparency``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["assert_state_close", "max_abs_diff"]


def max_abs_diff(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    return max(
        (float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].numel()),
        default=0.0,
    )


def assert_state_close(
    actual: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    *,
    atol: float = 1e-5,
    rtol: float = 0.0,
) -> None:
    """Same keys, same shapes, and every element within ``atol + rtol * |expected|``."""
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))
    if missing or extra:
        raise AssertionError(f"state keys differ: missing {missing[:5]}, unexpected {extra[:5]}")
    for name in expected:
        a, e = actual[name].double(), expected[name].double()
        if a.shape != e.shape:
            raise AssertionError(f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}")
        diff = (a - e).abs()
        bound = atol + rtol * e.abs()
        if bool((diff > bound).any()):
            worst = float(diff.max())
            raise AssertionError(
                f"{name} differs: max abs difference {worst:.3e} exceeds atol={atol:g}, rtol={rtol:g}"
            )

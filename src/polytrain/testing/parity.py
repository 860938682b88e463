"""Parity against a single-process reference: compare every tensor and name the one that differs.

The core correctness test of every synchronous strategy (ARCHITECTURE contract 1; torchgpipe's
``test_transparency``).

[Note: parity needs something to compare] Both helpers first check that the two states hold the
same keys and that there is at least one: a strategy that lost a parameter, or returned an empty
state on the rank under test, must fail the comparison, not pass it vacuously.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["assert_state_close", "max_abs_diff"]


def _check_comparable(
    actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]
) -> None:
    """[Note: parity needs something to compare]: same key sets, not empty, same shapes."""
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))
    if missing or extra:
        raise AssertionError(f"state keys differ: missing {missing[:5]}, unexpected {extra[:5]}")
    if not expected:
        raise AssertionError("both states are empty: there is nothing to compare")
    for name in expected:
        if actual[name].shape != expected[name].shape:
            raise AssertionError(
                f"{name}: shape {tuple(actual[name].shape)} != {tuple(expected[name].shape)}"
            )


def max_abs_diff(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> float:
    """The largest absolute element difference over all tensors of two states with the same
    keys and shapes (an `AssertionError` names the keys or shape that differ)."""
    _check_comparable(actual, expected)
    return max(
        (
            float((actual[k].double() - expected[k].double()).abs().max())
            for k in expected
            if expected[k].numel()
        ),
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
    _check_comparable(actual, expected)
    for name in expected:
        a, e = actual[name].double(), expected[name].double()
        diff = (a - e).abs()
        bound = atol + rtol * e.abs()
        if bool((diff > bound).any()):
            worst = float(diff.max())
            raise AssertionError(
                f"{name} differs: max abs difference {worst:.3e} exceeds atol={atol:g}, rtol={rtol:g}"
            )

"""`measure.probes`' per-tensor / per-byte fit of the end-of-step probes (pure arithmetic)."""

from __future__ import annotations

import pytest

from polytrain.measure.probes import fit_per_tensor_and_byte


def test_fit_recovers_both_terms() -> None:
    a, b = 40e-6, 3e-9
    points = [
        (n, nbytes, a * n + b * nbytes) for n, nbytes in ((256, 6.5e4), (64, 1e6), (4, 1.6e7))
    ]
    fit = fit_per_tensor_and_byte(points)
    assert fit == (pytest.approx(a), pytest.approx(b))


def test_a_negative_term_is_noise_and_refit_without_it() -> None:
    # seconds fall with the tensor count at equal bytes: the per-tensor term would be negative
    points = [(100.0, 1e6, 1e-3), (1.0, 1e6, 1.2e-3)]
    per_tensor, per_byte = fit_per_tensor_and_byte(points)
    assert per_tensor == 0.0
    assert per_byte == pytest.approx(1.1e-9)

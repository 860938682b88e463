"""Top-k and 1-bit sign compressors with error feedback (pure tensor math, no processes)."""

from __future__ import annotations

import pytest
import torch

from polytrain.comm.compressors import (
    Compressor,
    ErrorFeedback,
    SignCompressor,
    TopKCompressor,
)

SEGMENTS = [37, 100, 3]  # parameter tensors laid end to end
N = sum(SEGMENTS)


def compressors() -> dict[str, Compressor]:
    return {"topk": TopKCompressor(N, 0.05), "sign": SignCompressor(SEGMENTS)}


def test_sign_sends_signs_and_one_mean_magnitude_per_tensor() -> None:
    sign = SignCompressor(SEGMENTS)
    x = torch.randn(N)
    packet = sign.encode(x)
    assert packet.nbytes == (N + 7) // 8 + 4 * len(SEGMENTS)  # 18 bytes of bits, 3 scales
    out = sign.decode(packet)
    assert torch.equal(out.sign(), torch.where(x >= 0, 1.0, -1.0))
    start = 0
    for size in SEGMENTS:
        part = out[start : start + size]
        assert torch.allclose(part.abs(), x[start : start + size].abs().mean().expand(size))
        start += size


def test_topk_keeps_the_largest_entries() -> None:
    topk = TopKCompressor(N, 0.05)
    x = torch.randn(N)
    packet = topk.encode(x)
    assert topk.k == 7 and packet.nbytes == 7 * (4 + 4)
    out = topk.decode(packet)
    kept = out.nonzero().flatten()
    assert set(kept.tolist()) == set(x.abs().topk(7).indices.tolist())
    assert torch.equal(out[kept], x[kept])


@pytest.mark.parametrize("name", ["topk", "sign"])
def test_error_feedback_sends_the_running_sum_of_the_inputs(name: str) -> None:
    """With error feedback, sum(sent) = sum(inputs) - residual, and the residual stays bounded,
    so the relative gap shrinks as messages accumulate; without it the gap keeps growing."""
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(N, generator=gen) + 0.3 for _ in range(400)]
    ef = ErrorFeedback(compressors()[name], N)
    plain = compressors()[name]
    total = torch.zeros(N)
    sent_ef = torch.zeros(N)
    sent_plain = torch.zeros(N)
    gaps = []
    for t, x in enumerate(inputs, 1):
        _, sent = ef.compress(x)
        total += x
        sent_ef += sent
        sent_plain += plain.decode(plain.encode(x))
        assert torch.allclose(total - sent_ef, ef.residual, atol=1e-3)
        if t in (50, 400):
            gaps.append(float((total - sent_ef).norm() / total.norm()))
    assert gaps[1] < gaps[0] / 3  # the gap does not grow with the number of messages
    assert gaps[1] < 0.1
    plain_gap = float((total - sent_plain).norm() / total.norm())
    assert plain_gap > 3 * gaps[1]

"""The top-k / sign DDP hook in one process (a world of 1): error feedback per parameter, also
when DDP lays its bucket out anew, and the bytes it hands to c10d ([Note: sparse gradient
hook])."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from polytrain.comm.compression import SentBytes, SparseHookState, sparse_hook


class _Bucket:
    """What the hook reads of a `dist.GradBucket`: its parameters and their gradients laid end
    to end in one buffer."""

    def __init__(self, params: list[torch.Tensor], grads: dict[int, torch.Tensor]) -> None:
        self._params = params
        self._buffer = torch.cat([grads[id(p)].reshape(-1) for p in params])

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return self._params


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[Any]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["topk", "sign"])
def test_residuals_follow_the_parameters_when_the_bucket_is_laid_out_anew(
    kind: str, world_of_one: Any
) -> None:
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.zeros(40)), torch.nn.Parameter(torch.zeros(3, 7))
    sent = SentBytes()
    state = SparseHookState(world_of_one, kind, topk_ratio=0.1, sent=sent)
    total_in = {id(a): torch.zeros(40), id(b): torch.zeros(21)}
    total_out = {id(a): torch.zeros(40), id(b): torch.zeros(21)}
    # DDP's first bucket follows the parameters' order; the rebuilt one, the order their
    # gradients became ready in (here reversed).
    for layout in ([a, b], [b, a], [b, a]):
        grads = {id(p): torch.randn(p.numel()) for p in (a, b)}
        out = sparse_hook(state, _Bucket(layout, grads)).wait()  # type: ignore[arg-type]
        start = 0
        for p in layout:
            total_in[id(p)] += grads[id(p)]
            total_out[id(p)] += out[start : start + p.numel()]
            start += p.numel()
    for p in (a, b):
        # [Note: error feedback], per parameter: what was sent plus what is still owed is
        # exactly what came in, also across the change of layout.
        residual = state.residuals[id(p)]
        torch.testing.assert_close(total_out[id(p)] + residual, total_in[id(p)])
        assert residual.abs().sum() > 0  # the compression left something out
    n = 40 + 21
    packet = -(-n // 8) + 4 * 2 if kind == "sign" else -(-n // 10) * (4 + 4)
    assert sent.take() == 3 * packet  # one packet per bucket and step, handed to all_gather
    assert sent.take() == 0

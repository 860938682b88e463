"""`comm.p2p`: the shape handshake, channel shapes, and a process group per channel."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from polytrain.testing import run_distributed

pytestmark = pytest.mark.slow


def _channels_rank(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from polytrain.comm.p2p import P2P, PendingSends
    from polytrain.errors import ProtocolError

    act_group = dist.new_group([0, 1])
    grad_group = dist.new_group([0, 1])
    p2p = P2P(act_group, torch.device("cpu"), channel_groups={"grad": grad_group})
    out: dict[str, Any] = {}
    if rank == 0:
        pending = PendingSends()
        for k in range(3):  # all activations first, then all gradients
            p2p.isend(torch.full((2, 3), float(k)), 1, "act", pending)
        for k in range(3):
            p2p.isend(torch.arange(5, dtype=torch.int64) + k, 1, "grad", pending)
        try:
            p2p.isend(torch.zeros(4), 1, "act", pending)
        except ProtocolError as e:
            out["error"] = str(e)
        pending.wait()
    else:
        # Received in the opposite order: possible only because "grad" has its own group.
        out["grad"] = [p2p.recv(0, "grad").tolist() for _ in range(3)]
        out["act"] = [p2p.recv(0, "act").tolist() for _ in range(3)]
    return out


def test_channels_keep_order_shape_and_their_own_group() -> None:
    sender, receiver = run_distributed(_channels_rank, 2, timeout_s=60)
    assert receiver["grad"] == [[k, k + 1, k + 2, k + 3, k + 4] for k in range(3)]
    assert receiver["act"] == [[[float(k)] * 3] * 2 for k in range(3)]
    assert "carries (2, 3) torch.float32 but got (4,)" in sender["error"]

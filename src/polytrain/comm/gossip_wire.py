"""The wire of decentralized training: push weighted parameter copies to peers, sum what arrives.

One mixing round is one `torch.distributed.batch_isend_irecv` of flat tensors (shapes known on
both ends, so no header), and the averages over a group that evaluation, export and
checkpoints use. Bytes are counted where they are sent: the sizes of the tensors handed to c10d.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["all_gather_equal", "exchange", "nbytes", "weighted_average"]


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def exchange(
    sends: Sequence[tuple[int, torch.Tensor]],
    recvs: Sequence[tuple[int, torch.Tensor]],
    group: dist.ProcessGroup | None = None,
) -> int:
    """Send each ``(peer, tensor)`` of ``sends`` and receive into each ``(peer, buffer)`` of
    ``recvs``, all posted at once and waited for; returns the bytes handed to c10d to send.

    Peers are global ranks. At most one message per direction and peer per call, so the order
    of posting cannot mismatch two messages of one pair.
    """
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer, group) for peer, t in sends]
    ops += [dist.P2POp(dist.irecv, buf, peer, group) for peer, buf in recvs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return sum(nbytes(t) for _, t in sends)


def weighted_average(
    flat: torch.Tensor, weight: float, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """``sum_i w_i x_i / sum_i w_i`` over ``group`` (a new tensor): the network's average model.

    With push-sum weights (SGP) the replicas' values are ``x_i / w_i``, and the sum of ``x``
    over all nodes is what mixing preserves; with every ``w_i = 1`` this is the plain mean.
    """
    buffer = torch.cat([flat.detach().float() * weight, flat.new_tensor([weight]).float()])
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(buffer, group=group)
    return (buffer[:-1] / buffer[-1]).to(flat.dtype)


def all_gather_equal(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None
) -> tuple[list[torch.Tensor], int]:
    """Every rank's ``tensor`` (all of one shape, e.g. compressed messages of a fixed size), in
    rank order, and the bytes this rank handed to c10d to send."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [tensor], 0
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out, nbytes(tensor)

"""The wire of decentralized training: push weighted parameter copies to peers, sum what arrives.

One mixing round is one `torch.distributed.batch_isend_irecv` of flat tensors (shapes known on
both ends, so no header), and the averages over a group that evaluation, export and
checkpoints use. Bytes are counted where they are sent: the sizes of the tensors handed to c10d.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = [
    "PendingExchange",
    "all_gather_equal",
    "exchange",
    "nbytes",
    "start_exchange",
    "weighted_average",
    "wire_group",
]


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
    pending = start_exchange(sends, recvs, group)
    pending.wait()
    return pending.bytes_sent


class PendingExchange:
    """An exchange posted by `start_exchange` and not yet waited for.

    Holds the send tensors until `wait` (c10d reads them while the messages are in flight, so
    they must stay alive and unchanged) and the receive buffers it fills.
    """

    def __init__(
        self,
        works: list[dist.Work],
        sends: list[torch.Tensor],
        recvs: list[tuple[int, torch.Tensor]],
        bytes_sent: int,
    ) -> None:
        self._works, self._sends, self.recvs, self.bytes_sent = works, sends, recvs, bytes_sent

    def wait(self) -> list[tuple[int, torch.Tensor]]:
        """Block until every message of the exchange is sent and received; the filled
        ``(peer, buffer)`` receives, in the order they were given."""
        for work in self._works:
            work.wait()
        self._works, self._sends = [], []
        return self.recvs


def start_exchange(
    sends: Sequence[tuple[int, torch.Tensor]],
    recvs: Sequence[tuple[int, torch.Tensor]],
    group: dist.ProcessGroup | None = None,
) -> PendingExchange:
    """Post the sends and receives of `exchange` without waiting: the messages travel while the
    caller computes, and `PendingExchange.wait` completes them. At most one exchange per group
    should be outstanding (two would match one pair's messages by posting order alone)."""
    tensors = [(peer, t.contiguous()) for peer, t in sends]
    ops = [dist.P2POp(dist.isend, t, peer, group) for peer, t in tensors]
    ops += [dist.P2POp(dist.irecv, buf, peer, group) for peer, buf in recvs]
    works = list(dist.batch_isend_irecv(ops)) if ops else []
    sent = [t for _, t in tensors]
    return PendingExchange(works, sent, list(recvs), sum(nbytes(t) for t in sent))


def wire_group() -> dist.ProcessGroup | None:
    """Collective: a process group over the whole world for gossip messages alone (its own
    connections and, on NCCL, its own stream), so messages in flight do not queue the step's
    collectives behind them; None outside a distributed run."""
    return dist.new_group() if dist.is_initialized() else None


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

"""Gradient compression for DDP: communication hooks that replace the bucket all-reduce.

- bf16 / fp16 (`compress_hook`): all-reduce a bf16 or fp16 copy of each bucket. Halves the
  bytes on the wire at the price of rounding every gradient to 8 (bf16) or 11 (fp16)
  significant bits. Unlike torch's built-in bf16 hook, this one runs on gloo too.
- top-k / 1-bit sign (`sparse_hook`, [Note: sparse gradient hook]).
- PowerSGD (`powersgd_hook`): torch's own hook (Vogels et al., NeurIPS 2019), wrapped only to
  count its bytes.

Bytes are counted where they are sent: the sizes of the tensors handed to c10d, added to a
`SentBytes` the strategy reads once a step.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from polytrain.comm.compressors import Compressor, ErrorFeedback, build_compressor

__all__ = ["SentBytes", "SparseHookState", "compress_hook", "powersgd_hook", "sparse_hook"]


class SentBytes:
    """Bytes a hook handed to c10d since the last `take`."""

    def __init__(self) -> None:
        self.count = 0

    def take(self) -> int:
        """The bytes counted so far; the count restarts at 0."""
        count, self.count = self.count, 0
        return count


def compress_hook(
    dtype: torch.dtype, sent: SentBytes | None = None
) -> Callable[..., torch.futures.Future[torch.Tensor]]:
    """A DDP communication hook that averages buckets in ``dtype``; state is the process group."""

    def hook(
        group: dist.ProcessGroup, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(group.size())
        work = dist.all_reduce(compressed, group=group, async_op=True)
        assert work is not None
        if sent is not None:
            sent.count += compressed.numel() * compressed.element_size()

        def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            buffer.copy_(fut.value()[0])
            return buffer

        return work.get_future().then(decompress)

    return hook


def powersgd_hook(
    sent: SentBytes | None = None,
) -> Callable[..., torch.futures.Future[torch.Tensor]]:
    """torch's `powerSGD_hook`, counting what it hands to c10d: the whole bucket while it still
    all-reduces in full (``state.iter < start_powerSGD_iter``), then the elements torch itself
    books as sent for the bucket (``total_numel_after_compression``: the P and Q factors and
    the tensors left uncompressed, all in the bucket's dtype)."""

    def hook(
        state: powersgd.PowerSGDState, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        in_full = state.iter < state.start_powerSGD_iter
        booked = state.total_numel_after_compression
        fut = powersgd.powerSGD_hook(state, bucket)
        if sent is not None:
            numel = buffer.numel() if in_full else state.total_numel_after_compression - booked
            sent.count += numel * buffer.element_size()
        return fut

    return hook


class SparseHookState:
    """[Note: sparse gradient hook] The state of `sparse_hook`.

    Top-k and 1-bit sign packets cannot be summed on the wire (a sum of two top-k packets is
    not a top-k packet), so each rank compresses its bucket, ``C(g_i + e_i)`` with its error
    feedback ``e_i`` (`polytrain.comm.compressors.ErrorFeedback`), the packets (one uint8
    tensor of a size fixed by the bucket) are all-gathered, and every rank decodes all of them
    and takes their mean: the same gradient on every rank, ``mean_i C(g_i + e_i)``. The
    residual is kept per parameter, not per bucket, since DDP rebuilds its buckets (new order,
    new boundaries) after the first step; 1-bit sign keeps one scale per parameter tensor.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        kind: str,
        topk_ratio: float,
        sent: SentBytes | None = None,
    ) -> None:
        self.group, self.kind, self.topk_ratio, self.sent = group, kind, topk_ratio, sent
        self.residuals: dict[int, torch.Tensor] = {}  # id(parameter) -> its residual
        self.compressors: dict[tuple[int, ...], Compressor] = {}  # by the bucket's layout

    def compressor(self, sizes: list[int], key: tuple[int, ...]) -> Compressor:
        if key not in self.compressors:
            self.compressors[key] = build_compressor(self.kind, sizes, self.topk_ratio)
        return self.compressors[key]


def sparse_hook(
    state: SparseHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: the mean of every rank's decoded top-k / sign packet."""
    buffer = bucket.buffer()
    params = bucket.parameters()
    sizes = [p.numel() for p in params]
    assert sum(sizes) == buffer.numel(), "a DDP bucket is its parameters' gradients, end to end"
    compressor = state.compressor(sizes, tuple(id(p) for p in params))
    feedback = ErrorFeedback(compressor, buffer.numel(), buffer.device)
    for p, part in zip(params, feedback.residual.split(sizes), strict=True):
        if id(p) in state.residuals:
            part.copy_(state.residuals[id(p)])
    packet, _ = feedback.compress(buffer)
    for p, part in zip(params, feedback.residual.split(sizes), strict=True):
        state.residuals[id(p)] = part
    message = packet.to_bytes()
    world = state.group.size()
    gathered = [torch.empty_like(message) for _ in range(world)]
    work = dist.all_gather(gathered, message, group=state.group, async_op=True)
    assert work is not None
    if state.sent is not None:
        state.sent.count += message.numel() * message.element_size()

    def decode(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        fut.wait()
        total = compressor.decode(packet.like(gathered[0]))
        for b in gathered[1:]:
            total += compressor.decode(packet.like(b))
        buffer.copy_(total / world)
        return buffer

    return work.get_future().then(decode)

"""Data parallel (DDP): bucketed all-reduce of gradients overlapped with backward.

Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020.
Gradients become ready block by block in reverse order during backward; DDP packs them into
buckets of ``parallel.bucket_mb`` and starts a bucket's all-reduce as soon as it is full, so
only the all-reduce of the last buckets (and whatever backward could not hide) is exposed.
Derivation: docs/planner.md "Data parallel".
"""

from __future__ import annotations

from collections.abc import Sequence

from polytrain.planner.cost.common import Env
from polytrain.planner.cost.overlap import overlap

__all__ = ["bucket_sizes", "dp_backward", "replicate_backward"]


def bucket_sizes(
    grad_bytes_reversed: Sequence[float], bucket_bytes: float
) -> list[list[tuple[int, float]]]:
    """For each block in backward order, the buckets that become full when it ends, as
    (count, bytes) pairs. The last, partly filled bucket closes with the last block (DDP
    flushes it at the end of backward)."""
    out: list[list[tuple[int, float]]] = [[] for _ in grad_bytes_reversed]
    open_bytes = 0.0
    for k, nbytes in enumerate(grad_bytes_reversed):
        open_bytes += nbytes
        full = int(open_bytes // bucket_bytes)
        if full:
            out[k].append((full, bucket_bytes))
            open_bytes -= full * bucket_bytes
    if open_bytes > 0 and out:
        out[-1].append((1, open_bytes))
    return out


def dp_backward(
    env: Env,
    bwd_s: Sequence[float],
    grad_bytes: Sequence[float],
    dp: int,
    stride: int,
) -> tuple[float, float]:
    """(backward + all-reduce end time, exposed communication) for blocks in FORWARD order.

    ``bwd_s[k]`` and ``grad_bytes[k]`` belong to block ``k``; backward runs them reversed.
    """
    rev_s = list(reversed(bwd_s))
    if dp <= 1:
        return sum(rev_s), 0.0
    buckets = bucket_sizes(list(reversed(grad_bytes)), env.bucket_bytes)
    after = [
        sum(c * env.collective_s("all_reduce", b, dp, stride) for c, b in bs) for bs in buckets
    ]
    return overlap(rev_s, after=after)


def replicate_backward(
    env: Env,
    bwd_s: Sequence[float],
    grad_bytes: Sequence[float],
    dp: int,
    stride: int,
) -> tuple[float, float]:
    """`dp_backward` for FSDP2's ``replicate`` (data parallel over tensor-parallel ranks,
    `parallel.replicate`): one all-reduce per block, issued when its gradients are ready. On a
    CPU host FSDP2 runs it synchronously in the block's post-backward hook ([Note: FSDP2 on a
    CPU host] in cost/zero.py): every one exposed. On an accelerator it overlaps the rest of
    backward, priced as DDP's buckets (`dp_backward`, as before)."""
    if dp <= 1 or env.cluster.device.key != "cpu":
        return dp_backward(env, bwd_s, grad_bytes, dp, stride)
    after = [env.collective_s("all_reduce", b, dp, stride) for b in grad_bytes]
    return sum(bwd_s) + sum(after), sum(after)

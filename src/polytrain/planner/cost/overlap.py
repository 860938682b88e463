"""Two streams, compute and communication, as DDP and FSDP2 run them (pure).

[Note: two-stream overlap] Compute tasks run in order on one stream. Each task ``k`` may need a
communication ``before[k]`` to have finished (an FSDP all-gather of the block's parameters) and
may issue one ``after[k]`` when it ends (a DDP bucket's all-reduce, an FSDP reduce-scatter).
``before[k]`` is issued when compute ``k - 1`` starts (prefetch depth one, FSDP2's default
implicit prefetch), ``before[0]`` at time 0. Communication runs on one stream, first issued
first served, each task after the previous one (NCCL and gloo serialize a process group's
collectives). The result is when both streams are done.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["overlap"]


def overlap(
    compute: Sequence[float],
    before: Sequence[float] | None = None,
    after: Sequence[float] | None = None,
) -> tuple[float, float]:
    """(end of both streams, communication time not hidden behind compute)."""
    n = len(compute)
    pre = list(before) if before is not None else [0.0] * n
    post = list(after) if after is not None else [0.0] * n
    comm_free = 0.0
    t = 0.0  # compute stream clock
    pre_done = [0.0] * n
    # before[0] is issued at 0; before[k] when compute k-1 starts, i.e. interleaved below.
    if n and pre[0] > 0:
        comm_free = pre_done[0] = pre[0]
    pending_post: list[tuple[float, float]] = []  # (issue time, seconds)

    def run_comm(issue: float, secs: float) -> float:
        nonlocal comm_free
        start = max(comm_free, issue)
        comm_free = start + secs
        return comm_free

    for k in range(n):
        start = max(t, pre_done[k]) if pre[k] > 0 else t
        # issue the prefetch of k+1 at the start of k, after any post-comm already issued
        for issue, secs in pending_post:
            run_comm(issue, secs)
        pending_post.clear()
        if k + 1 < n and pre[k + 1] > 0:
            pre_done[k + 1] = run_comm(start, pre[k + 1])
        t = start + compute[k]
        if post[k] > 0:
            pending_post.append((t, post[k]))
    for issue, secs in pending_post:
        run_comm(issue, secs)
    end = max(t, comm_free)
    return end, end - sum(compute)

"""Timed collectives for `polytrain calibrate`: seconds per call by message size.

Every rank of the default group calls the same function with the same sizes; the result is the
slowest rank's median (a collective finishes when its last rank does), agreed by a MAX
all-reduce so every rank returns the same numbers. Point-to-point is a ping-pong between ranks 0
and 1 (half the round trip: latency plus one transfer), the other ranks idle; `time_p2p_posted`
times the same bounce with every receive posted before its message is sent.

[Note: posted receives] gloo's TCP pair moves a message only once its receive is posted: a send
whose receive is not posted yet waits for the receiver's "ready" notice, one more trip between
two processes that each have to be woken (on a 2-core VM that trip is bimodal, 0.1 ms or 1-3
ms). `time_collective`'s ``p2p`` posts each receive as it needs it (``dist.recv``), so it pays
that trip whenever the sender is first. The pipeline runtime posts its receives ahead ([Note:
early receives] in pipeline/runtime.py), so its messages find their receive posted:
`time_p2p_posted` measures that case. Ranks 0 and 1 bounce one message, each posting
its next receive before it sends its reply, so every send of the stream finds its receive
posted; one way is the stream's time over twice its round trips. Measured on this VM at 4 KiB
(back to back, idle host): a blocking ``send``/``recv`` stream 0.9-1.8 ms one way, the posted
stream 0.08-0.19 ms.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from polytrain.comm.collectives import collective_device

__all__ = ["COLLECTIVES", "time_collective", "time_p2p_posted"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p")

# torch 2.13 renamed the flat-tensor collectives (the old names warn); older torch has only those.
_ALL_GATHER: Callable[..., object] = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER: Callable[..., object] = getattr(
    dist, "reduce_scatter_single", dist.reduce_scatter_tensor
)


def _op(name: str, nbytes: int, device: torch.device) -> Callable[[], object]:
    world = dist.get_world_size()
    rank = dist.get_rank()
    numel = max(nbytes // 4, world)
    numel -= numel % world  # reduce-scatter and all-gather split the message evenly
    if name == "all_reduce":
        buf = torch.ones(numel, device=device)
        return lambda: dist.all_reduce(buf)
    if name == "all_gather":  # each rank contributes 1/world of the message
        out = torch.zeros(numel, device=device)  # touched here: the timed call pays no faults
        part = torch.ones(numel // world, device=device)
        return lambda: _ALL_GATHER(out, part)
    if name == "reduce_scatter":
        full = torch.ones(numel, device=device)
        part = torch.zeros(numel // world, device=device)
        return lambda: _REDUCE_SCATTER(part, full)
    if name == "p2p":
        buf = torch.ones(numel, device=device)

        def ping_pong() -> None:
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        return ping_pong
    raise ValueError(f"unknown collective {name!r}: expected one of {', '.join(COLLECTIVES)}")


def time_collective(
    name: str,
    nbytes: int,
    *,
    iters: int = 5,
    budget_s: float = 1.0,
    warmup: bool = True,
    mean: bool = False,
) -> float:
    """Median (``mean=True``: mean) seconds of one ``name`` over a message of ``nbytes`` (at
    least ``iters`` calls or until ``budget_s`` is spent, whichever is fewer after the first
    two), the max over ranks. ``warmup=False`` skips the untimed first call (a caller timing the
    same op again)."""
    device = collective_device()
    fn = _op(name, nbytes, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if warmup:
        fn()  # warm-up: connection set-up and allocation
        sync()
    times: list[float] = []
    spent = 0.0
    # Every rank must run the same number of calls, so the count is agreed after each call.
    flag = torch.zeros(1, device=device)
    while True:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        elapsed = time.perf_counter() - t0
        if name == "p2p":
            elapsed /= 2  # one way of the round trip
        times.append(elapsed)
        spent += elapsed
        flag.fill_(1.0 if len(times) >= iters or (len(times) >= 2 and spent > budget_s) else 0.0)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            break
    result = torch.tensor([(statistics.mean if mean else statistics.median)(times)], device=device)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    return float(result.item())


def _posted(work: dist.Work | None) -> dist.Work:
    assert work is not None, "this rank is not in the default group"
    return work


def time_p2p_posted(nbytes: int, round_trips: int = 16) -> float:
    """One-way seconds of a message of ``nbytes`` whose receive is already posted, between ranks
    0 and 1 (the other ranks only join the barrier and the agreement): [Note: posted receives].
    The max over ranks, as `time_collective`."""
    rank = dist.get_rank()
    peer = 1 - rank
    numel = max(nbytes // 4, 1)
    out = torch.ones(numel)
    into = torch.empty(numel)
    if rank >= 2:
        dist.barrier()
        t0 = time.perf_counter()
    else:
        work = _posted(dist.irecv(into, peer))  # posted before the clock starts
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(round_trips):
            if rank == 0:  # send, then wait for the reply; its next receive is posted first
                _posted(dist.isend(out, 1)).wait()
                work.wait()
                if i + 1 < round_trips:
                    work = _posted(dist.irecv(into, 1))
            else:  # the next receive is posted before the reply leaves
                work.wait()
                if i + 1 < round_trips:
                    work = _posted(dist.irecv(into, 0))
                _posted(dist.isend(out, 0)).wait()
    elapsed = torch.tensor([(time.perf_counter() - t0) / (2 * round_trips)])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())

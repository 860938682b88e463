"""How ranks on one host slow each other, measured for `polytrain calibrate` (torch-facing).

Three probes, each run on every world size the calibration measures and kept per rank count in
the `HostProfile`: how much slower one process computes beside the others ([Note: shared
cores, measured on a step]: `step_slowdown`), how much a step that waits for every rank adds
for the slowest of them ([Note: ranks' skew]: `sync_wait_s`, `step_skew`), and what the end of
step's small all-reduces cost between the ranks' compute ([Note: the step's reductions in a step]:
`reduce_in_step`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from polytrain.measure.timing import synchronised_seconds, timed

__all__ = ["rank_reduce_in_step", "rank_step_slowdown", "rank_sync_wait"]


def _layer_step() -> Callable[[], None]:
    """One transformer layer's forward + backward (width 128, 64 tokens, 8 samples: matmuls of
    128 to 512, softmax, layer norms, the autograd engine), seeded: the unit of a step's
    compute the contention probes time."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True)
    x = torch.randn(8, 64, 128)

    def step() -> None:
        layer(x).sum().backward()

    return step


# [Note: shared cores, measured on a step]
# The cost model slows every CPU-bound time by how much slower one process computes beside the
# host's other computing ranks ([Note: shared cores] in cost/common.py). Measured with 1024-wide
# fp32 matmuls (`HostProfile.matmul_concurrent`) that factor overstates what a training step
# meets: on a 2-vCPU Xeon VM (2026-11-26) two processes at once slowed a 1024 matmul 1.35x (and
# the calibration's reading was 1.7x, spread 38%) but a transformer layer's forward + backward
# (width 128, 64 tokens: matmuls of 128 to 512, softmax, layer norms, the autograd engine) only
# 1.09x; with four, 2.7x and 2.5x. Two-process layouts of gpt tiny were then predicted 25-50%
# slow. `rank_step_slowdown` times such a layer alone on rank 0 and on every rank at once, in
# alternating rounds, and answers the fastest "at once" round over the fastest "alone" one;
# `calibrate` keeps it per rank count (`HostProfile.step_slowdown`), which `Env.cpu_slowdown`
# prefers to the matmul rates. The fastest rounds, not the median of paired ratios (the first
# version): a burst of the host's other load lands on some rounds and only ever adds time, and
# one calibration at 11:51 whose rounds met such bursts read 1.64x for two processes where the
# quiet ones read 1.03 and 1.09 (every two-process gpt tiny layout then predicted 30-70% slow).
_SLOWDOWN_ROUNDS = 8


def rank_step_slowdown(rank: int, world: int, budget_s: float) -> float:
    """[Note: shared cores, measured on a step] How much longer one transformer layer's forward
    + backward takes on the slowest of ``world`` processes running it at once than on one alone
    (the fastest round of each; rank 0's answer is the figure)."""
    device = torch.device("cpu")
    step = _layer_step()
    step()
    alone, together = math.inf, math.inf
    for _ in range(_SLOWDOWN_ROUNDS):
        torch.distributed.barrier()
        if rank == 0:
            alone = min(alone, timed(step, device, budget_s))
        torch.distributed.barrier()
        slowest = torch.tensor([timed(step, device, budget_s)])
        torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
        together = min(together, float(slowest.item()))
    return together / alone if rank == 0 else 1.0


# [Note: ranks' skew]
# A step that synchronizes its ranks (DDP's all-reduce, FSDP2's collectives, tensor
# parallelism's per-layer all-reduces, the end of step's [loss, flag] reduce, a synchronous
# parameter server) ends when its slowest rank gets there. Ranks sharing a host's cores do not
# compute at an even pace: the OS, the other processes and the host's own neighbours stall one
# rank or another for a while, and every stall of any rank is waited out by all of them. The
# slowdown factor above cannot see it (it compares each rank's own time, over many calls), nor
# can the isolated collective curves (timed from a barrier, around no compute). Measured on the
# 2-vCPU Xeon VM (2026-11-27, gpt tiny's forward + backward of 16 samples on two ranks, a
# one-float all-reduce after each step against none): 2-4% more per step on two ranks, 7-8% on
# four; the two-rank gpt tiny layouts of the planner benchmark read 5-20% slower than priced in
# every run of 2026-11-26, where dp1 was priced within 3%.
# The wait is mostly a price per synchronization, not a share of the step: on the 2-vCPU AMD
# VM (2026-11-27 20:40), compute then a one-float all-reduce, against the compute alone and
# the all-reduce alone, waited 0.7-1.0 ms per synchronization after 2.4-3 ms of matmuls and
# 0.8-1.9 ms after a 27 ms transformer layer on two ranks; 0.9-1.2 and 2.0-2.1 ms on four.
# Read as a share of the compute alone (the first version of this probe, 4 layers) it priced
# the mlp tiny's steps of a few ms, with two to five synchronizations each, at 0.06 ms where
# `benchmarks/planner/phases.py` found ~0.8 ms per synchronizing phase (each phase's mean over
# its median). `rank_sync_wait` times rounds of `_SKEW_STEPS` steps of two lengths (`_SHORT`
# matmuls of 160, then one transformer layer), free and with that all-reduce after each, and
# the all-reduce alone; over the rounds' medians it fits wait = a + b x compute through the
# two lengths: ``a`` seconds per synchronization (`HostProfile.sync_wait_s`) and ``b`` the
# share of the compute between them (`HostProfile.step_skew`), both >= 0, per rank count.
# `Env.skew_s` prices ``a`` for each synchronization a layout's step makes at a price timed
# without compute before it (DDP's buckets and FSDP2's replicate at the isolated curves,
# tensor parallelism's collectives, the DTensor clip's norm: [Note: synchronizations priced
# apart] in cost/hybrid.py) and ``b`` of each rank's own work (compute, the end of step,
# FSDP2's hooks, the loop) for the layouts whose ranks all wait for each other every step
# (data and tensor parallel, ZeRO, their hybrids; a synchronous parameter server's workers pay
# the share of their compute with its check and clip: their exchange's figure is timed in the
# real step loop, its waits in it). A pipeline's waits are its simulated schedule's;
# asynchronous modes wait for nobody. The one-float all-reduce is priced
# apart (`Env.step_reduce_s`), hence taken out.
_SKEW_STEPS = 6  # steps per timed run
_SKEW_ROUNDS = 12
_SKEW_REDUCES = 20  # back-to-back all-reduces timed for the one the synced steps carry
_SHORT = 10  # 160 x 160 matmuls of the short step (a few ms on a 2-vCPU VM)


def rank_sync_wait(rank: int, world: int) -> tuple[float, float]:
    """[Note: ranks' skew] (seconds per synchronization, share of the compute between them)
    that waiting for the slowest of ``world`` ranks adds when they all synchronize after every
    step (every rank answers the same figures)."""
    layer = _layer_step()
    a = torch.randn(160, 160)
    flag = torch.zeros(1)

    def short() -> None:
        for _ in range(_SHORT):
            torch.mm(a, a)

    def reduce() -> None:
        torch.distributed.all_reduce(flag)

    def slowest(fn: Callable[[], None], calls: int, then: Callable[[], None] | None) -> float:
        torch.distributed.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
            if then is not None:
                then()
        mean = torch.tensor([(time.perf_counter() - t0) / calls])
        torch.distributed.all_reduce(mean, op=torch.distributed.ReduceOp.MAX)
        return float(mean.item())

    layer()
    reduce()
    free: dict[int, list[float]] = {0: [], 1: []}
    waited: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(_SKEW_ROUNDS):
        alone = slowest(reduce, _SKEW_REDUCES, None)
        for k, compute in enumerate((short, layer)):
            bare = slowest(compute, _SKEW_STEPS, None)
            free[k].append(bare)
            waited[k].append(slowest(compute, _SKEW_STEPS, reduce) - alone - bare)
    (c0, c1), (w0, w1) = (
        [statistics.median(free[k]) for k in (0, 1)],
        [statistics.median(waited[k]) for k in (0, 1)],
    )
    share = max((w1 - w0) / (c1 - c0), 0.0) if c1 > c0 else 0.0
    return max(w0 - share * c0, 0.0), share


# [Note: the step's reductions in a step]
# `core.step.finish_step` all-reduces two floats every step (the loss and the non-finite flag)
# and one more when it clips sharded gradients (the squared norm: `cost/parts.step_reduce_s`).
# The isolated curves price such a message at their smallest point, timed from a barrier (every
# rank leaves it at a different moment, and the first waits for the last: [Note: a small
# collective's price is its mean] in measure/calibrate.py): 1.4-1.6 ms on two ranks and 4.1-4.5
# ms on four in the 2026-11-26 calibrations of the 2-core VM. In a step the ranks reach the
# reduce from their own compute, and on that VM it cost 0.3-0.7 ms on two ranks and 1.8-1.9 ms
# on four (2026-11-26 evening, 200 calls after four 160 x 160 matmuls each, less the same
# matmuls alone); a trace of mlp tiny's dp2 step showed 0.7 ms more after backward than dp1's.
# At the isolated price the mlp's two-rank layouts carried 1-2 ms too much of a 4-9 ms step.
# A pipeline's stages do not reach the reduce together: GPipe's last stage ends its flush ~1 ms
# before the first and waits, blocked (a trace of mlp tiny's pp2 GPipe step: 0.8 ms from the
# first stage's last backward to its update, 1.7 ms on the last stage), so pipelines keep the
# isolated price, whose timing from a barrier has the same wait in it.
# `rank_reduce_in_step` times that reduce between compute in `_REDUCE_ROUNDS` rounds of the
# matmuls alone and the matmuls each followed by the reduce; `calibrate` keeps the median of the
# rounds' differences per call for each world size it runs (`HostProfile.reduce_in_step`), which
# `Env.step_reduce_s` uses for groups on the calibrated CPU host.
_REDUCE_CALLS = 8  # reduces per timed call (after each, the compute)
_REDUCE_ROUNDS = 3


def rank_reduce_in_step(rank: int, world: int) -> float:
    """[Note: the step's reductions in a step] Seconds one all-reduce of two floats adds when
    every rank reaches it from its own compute (the slowest rank's figure)."""
    torch.manual_seed(0)
    a = torch.randn(160, 160)
    flags = torch.zeros(2)

    def compute() -> None:
        for _ in range(4):
            torch.mm(a, a)

    def plain() -> None:
        for _ in range(_REDUCE_CALLS):
            compute()

    def reduced() -> None:
        for _ in range(_REDUCE_CALLS):
            compute()
            torch.distributed.all_reduce(flags)

    extra = []
    for _ in range(_REDUCE_ROUNDS):
        extra.append(synchronised_seconds(reduced) - synchronised_seconds(plain))
    return max(statistics.median(extra) / _REDUCE_CALLS, 0.0)

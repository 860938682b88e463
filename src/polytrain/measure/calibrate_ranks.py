"""What `polytrain calibrate` measures on several ranks at once: the gloo collectives' curves by
world size, and what ranks that compute at once cost each other (one process's matmul rate and
a step's slowdown beside the others, the ranks' skew, the step's small reductions between
compute), plus FSDP2's and tensor parallelism's collectives inside a step. Each runs on
`polytrain.testing`'s gloo harness (file:// rendezvous, spawned processes), one launch per world
size; `measure.calibrate` folds the figures into the `HostProfile`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from polytrain.comm.collectives import barrier
from polytrain.comm.probe import COLLECTIVES, time_collective
from polytrain.measure.contention import rank_reduce_in_step, rank_step_slowdown, rank_sync_wait
from polytrain.measure.probes import rank_dtensor_clip_call, rank_fsdp_in_step, rank_tp_in_step
from polytrain.measure.timing import Rounds, median_and_spread
from polytrain.planner.types import Curve
from polytrain.testing.harness import run_distributed

__all__ = [
    "COLLECTIVE_ROUNDS",
    "SMALL_MESSAGE_BYTES",
    "WorldFigures",
    "matmul_rates",
    "matmul_rounds",
    "measure_fsdp_in_step",
    "measure_tp_in_step",
    "measure_worlds",
]

_MB = 2**20
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

COLLECTIVE_ROUNDS = 3  # sweeps over every (collective, size), one timed call each ...
SMALL_MESSAGE_BYTES, SMALL_MESSAGE_CALLS = _MB, 8
"""... but a message of at most ``SMALL_MESSAGE_BYTES`` is priced at the mean of
``SMALL_MESSAGE_CALLS`` calls in each sweep ([Note: a small collective's price is its mean])."""

# [Note: a small collective's price is its mean]
# On the 2-core VM a small collective is bimodal: most calls take 0.3-0.6 ms, one in five to
# three takes ~4 ms (a rank woken late, probably at the next tick: this kernel runs at 250 Hz),
# at every size up to ~1 MiB and whether or not the ranks compute between calls (2026-11-25
# evening, 40 gloo all-reduces of 16 B to 1 MiB, world 2: medians 0.4-3.1 ms from one size to
# the next, means 1.4-2.8 ms). A median of three calls, as the curves were measured before,
# lands on either mode by chance: the saved curve priced a 4 KiB all-reduce at 4.2 ms and a
# 64 KiB one at 0.5. A step pays the mean of what its collectives cost, so a small message is
# priced at the mean of 8 calls per sweep (24 in all); between two runs of that experiment the
# means moved by at most 1.4x, the medians by up to 3.5x. Larger messages are bandwidth-bound
# and keep the median of the sweeps.


def matmul_rounds(
    sizes: tuple[int, ...],
    dtypes: tuple[str, ...],
    device: torch.device,
    budget_s: float,
    threads: int | None = None,
) -> Rounds[tuple[str, int]]:
    """Rounds of an n x n @ n x n matmul per (dtype, n), every size and dtype interleaved in
    each round ([Note: timing rounds]); `matmul_rates` turns their result into FLOP/s."""
    fns: dict[tuple[str, int], Callable[[], object]] = {}
    for dtype in dtypes:
        for n in sizes:
            a = torch.randn(n, n, device=device).to(_DTYPES[dtype])
            b = torch.randn(n, n, device=device).to(_DTYPES[dtype])
            fns[(dtype, n)] = partial(torch.matmul, a, b)
    return Rounds(fns, device, budget_s, threads=threads)


def matmul_rates(rounds: Rounds[tuple[str, int]]) -> dict[tuple[str, int], tuple[float, float]]:
    """(FLOP/s, spread) per (dtype, n) of `matmul_rounds`, running the rounds left."""
    return {
        (dtype, n): (2.0 * n**3 / secs, spread)
        for (dtype, n), (secs, spread) in rounds.result().items()
    }


def rank_collectives(
    rank: int,
    world: int,
    ops: tuple[str, ...],
    sizes: tuple[int, ...],
    budget_s: float,
    matmul_n: int,
) -> dict[str, list[tuple[float, float]]]:
    """Each op's (bytes, seconds) curve, under "<op> spread" its (bytes, spread) points, and
    under "matmul" (n, fp32 FLOP/s of this process while every rank multiplies at once: cores
    are shared, on a 2-core host four workers get about half a core each) and "matmul_spread"
    (n, its spread). [Note: timing rounds]: every (op, size) is timed once in each of
    `COLLECTIVE_ROUNDS` sweeps over all of them (one call each, after a warm-up call in the
    first sweep: 4 calls where the single run of before made 3 to 6), and its seconds are the
    median of the sweeps; the matmul's rounds run between the sweeps, every rank's after a
    barrier. Under "step_slowdown" (world, rank 0's `rank_step_slowdown`: [Note: shared cores,
    measured on a step] in measure/contention.py), under "sync_wait" (world, seconds per
    synchronization) and "step_skew" (world, share) the two of `rank_sync_wait` ([Note: ranks'
    skew]), under "reduce_in_step" (world, `rank_reduce_in_step`: [Note: the
    step's reductions in a step]), under "dtensor_clip_call" (world, `rank_dtensor_clip_call`:
    [Note: DTensor clip per call] in measure/probes.py)."""
    cpu = torch.device("cpu")
    matmul = matmul_rounds((matmul_n,), ("fp32",), cpu, max(budget_s, 0.2))
    sweeps: dict[tuple[str, int], list[float]] = {(op, n): [] for op in ops for n in sizes}
    for sweep in range(COLLECTIVE_ROUNDS):
        for i, (op, n) in enumerate(sweeps):
            # a warm-up call for every op in the first sweep, and for the first op of each
            # later one (it follows the matmul round)
            warmup = sweep == 0 or i == 0
            small = n <= SMALL_MESSAGE_BYTES
            iters = SMALL_MESSAGE_CALLS if small else 1
            secs = time_collective(op, n, iters=iters, budget_s=budget_s, warmup=warmup, mean=small)
            sweeps[(op, n)].append(secs)
        barrier()
        matmul.round()
    while not matmul.done:
        barrier()
        matmul.round()
    out: dict[str, list[tuple[float, float]]] = {}
    for (op, n), values in sweeps.items():
        secs, spread_n = median_and_spread(values)
        if n <= SMALL_MESSAGE_BYTES:  # [Note: a small collective's price is its mean]
            secs = statistics.mean(values)
        out.setdefault(op, []).append((float(n), secs))
        out.setdefault(f"{op} spread", []).append((float(n), spread_n))
    rate, spread = matmul_rates(matmul)[("fp32", matmul_n)]
    out["matmul"] = [(float(matmul_n), rate)]
    out["matmul_spread"] = [(float(matmul_n), spread)]
    out["step_slowdown"] = [(float(world), rank_step_slowdown(rank, world, budget_s / 4))]
    wait, share = rank_sync_wait(rank, world)
    out["sync_wait"] = [(float(world), wait)]
    out["step_skew"] = [(float(world), share)]
    out["reduce_in_step"] = [(float(world), rank_reduce_in_step(rank, world))]
    out["dtensor_clip_call"] = [(float(world), rank_dtensor_clip_call(rank, world))]
    return out


@dataclass(frozen=True)
class WorldFigures:
    """`measure_worlds`'s figures, each by world size."""

    collectives: dict[str, dict[int, Curve]]  # op -> world -> (bytes, seconds)
    matmul_concurrent: dict[int, float]  # fp32 FLOP/s of the slowest rank, all multiplying
    step_slowdown: dict[int, float]  # [Note: shared cores, measured on a step]
    sync_wait: dict[int, float]  # [Note: ranks' skew]: seconds per synchronization
    step_skew: dict[int, float]  # [Note: ranks' skew]: share of the compute between them
    reduce_in_step: dict[int, float]  # [Note: the step's reductions in a step]
    dtensor_clip_call: dict[int, float]  # [Note: DTensor clip per call]
    spread: dict[str, float]  # [Note: timing rounds]


def measure_worlds(
    world_sizes: tuple[int, ...],
    message_bytes: tuple[int, ...],
    budget_s: float,
    matmul_n: int,
    tell: Callable[[str], None],
) -> WorldFigures:
    """`rank_collectives` on each of ``world_sizes`` (p2p on two ranks only), one launch each;
    ``tell`` hears each world size done."""
    figures = WorldFigures({op: {} for op in COLLECTIVES}, {}, {}, {}, {}, {}, {}, {})
    for world in world_sizes:
        ops = COLLECTIVES if world == 2 else tuple(op for op in COLLECTIVES if op != "p2p")
        results = run_distributed(
            rank_collectives,
            world,
            ops,
            message_bytes,
            budget_s,
            matmul_n,
            timeout_s=1800.0,
            collective_timeout_s=600.0,
        )
        figures.matmul_concurrent[world] = min(r.pop("matmul")[0][1] for r in results)  # slowest
        figures.step_slowdown[world] = results[0]["step_slowdown"][0][1]  # rank 0's: the figure
        figures.sync_wait[world] = results[0]["sync_wait"][0][1]  # every rank's: the slowest
        figures.step_skew[world] = results[0]["step_skew"][0][1]  # likewise
        figures.reduce_in_step[world] = results[0]["reduce_in_step"][0][1]  # likewise
        figures.dtensor_clip_call[world] = results[0]["dtensor_clip_call"][0][1]  # likewise
        figures.spread[f"matmul fp32, {world} at once"] = max(
            r.pop("matmul_spread")[0][1] for r in results
        )
        for op in ops:
            figures.collectives[op][world] = Curve(tuple(results[0][op]))
            # the curve's spread: the median over its sizes ([Note: timing rounds])
            spreads = [s for _, s in results[0][f"{op} spread"]]
            figures.spread[f"{op} world {world}"] = statistics.median(spreads)
        tell(f"collectives, world {world}")
    return figures


def measure_fsdp_in_step(hooks: dict[int, float]) -> dict[int, Curve]:
    """[Note: FSDP2 collectives in a step] in measure/probes.py: per ZeRO stage, a unit's
    collectives inside a step on two ranks by its parameter bytes: what FSDP2 added per unit
    there, less its hooks (``hooks``: `fsdp_unit_s`, measured on one rank)."""
    (measured,) = run_distributed(rank_fsdp_in_step, 2, timeout_s=300.0)[:1]
    return {
        stage: Curve(tuple((b, max(t - hooks.get(stage, 0.0), 0.0)) for b, t in points))
        for stage, points in measured.items()
    }


def measure_tp_in_step(
    ranks: tuple[int, ...], dispatch_s: float, slower: Callable[[int], float]
) -> dict[int, Curve]:
    """[Note: tensor-parallel collectives in a step] in measure/probes.py: per count of ranks
    on the host, one tp all-reduce inside a step on groups of two by its bytes: half of what
    tensor parallelism added per column- then row-wise pair there, less one module's DTensor
    dispatch (``dispatch_s``: `tp_module_s`, one process alone, slowed as the cost model slows
    it with that many processes computing: ``slower(n)``, [Note: shared cores])."""
    out = {}
    for n in ranks:
        slowdown = slower(n)
        (measured,) = run_distributed(rank_tp_in_step, n, timeout_s=300.0)[:1]
        out[n] = Curve(tuple((b, max(t / 2 - dispatch_s * slowdown, 0.0)) for b, t in measured))
    return out

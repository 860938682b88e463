"""Partition trials: time candidate partitions of a block pipeline inside the real pipeline,
so `choose_partition` can pick the fastest ([Note: partition trials] in `pipeline.profile`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from polytrain.comm.collectives import all_reduce_max_, barrier
from polytrain.config.parallel import RecomputePolicy
from polytrain.models.base import BlockModel
from polytrain.pipeline.partition import block_ranges
from polytrain.pipeline.profile import leaves_no_trace
from polytrain.pipeline.runtime import Feed, StageRuntime
from polytrain.pipeline.schedule import Action
from polytrain.pipeline.stage import StageModule, build_stage

__all__ = ["PARTITION_TRIAL_ROUNDS", "time_partitions"]

PARTITION_TRIAL_ROUNDS = 3  # timed steps per candidate ([Note: partition trials])


def time_partitions(
    model: BlockModel,
    sample: tuple[torch.Tensor, torch.Tensor],
    candidates: list[list[int]],
    *,
    stage_index: int,
    program: Sequence[Action],
    microbatches: int,
    recompute: RecomputePolicy,
    runtime_for: Callable[[dict[int, StageModule]], StageRuntime],
    device: torch.device,
) -> list[float]:
    """Seconds per synchronous step of each candidate partition (the same on every rank).

    This rank runs its stage ``stage_index`` of every candidate on ``sample`` (every
    micro-batch the same) with ``program`` (its actions of the job's schedule; 1F1B's order for
    PipeDream), forward and backward only, each on a runtime from ``runtime_for`` (fresh
    channels: boundary shapes differ between candidates): gradients are dropped, no update,
    and the RNG and buffers are restored (`leaves_no_trace`), so training is unchanged. Every
    step starts after a barrier and lasts until its slowest rank is done (the maximum over the
    world). The candidates are interleaved over rounds, so drift in the machine's load hits all
    alike; each gets the median of its rounds after the first.
    """
    x, y = sample
    feed = Feed(inputs=lambda i: x, targets=lambda i: y, scale=1.0 / microbatches)
    runtimes = []
    for counts in candidates:  # one stage per rank: `auto` is refused otherwise (checks.py)
        start, stop = block_ranges(counts)[stage_index]
        stage = build_stage(model, start, stop, recompute=recompute)
        runtimes.append(runtime_for({stage_index: stage}))
    rounds = 1 + PARTITION_TRIAL_ROUNDS  # the first round warms up
    times = torch.zeros(rounds, len(candidates), dtype=torch.float64)
    with leaves_no_trace(model, device):
        for r in range(rounds):
            for n, runtime in enumerate(runtimes):
                barrier()  # every rank starts the step together: no skew from the last one
                t0 = time.perf_counter()
                runtime.run(program, feed)
                runtime.finish()
                times[r, n] = time.perf_counter() - t0
                for module in runtime.stages.values():
                    for param in module.parameters():
                        param.grad = None
    step = all_reduce_max_(times, None)  # a step lasts until its slowest rank is done
    return [float(v) for v in step[1:].median(dim=0).values]

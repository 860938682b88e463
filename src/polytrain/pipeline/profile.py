"""Profile each block of a `BlockModel` on the local device, and choose the pipeline partition.

The measuring half of PipeDream's partitioner (Narayanan et al. SOSP 2019, section 3.1): run
every block once per repeat on a sample micro-batch, record forward and backward time and the
bytes it keeps, then hand the profiles to the pure search in `polytrain.pipeline.partition`.

[Note: profiling leaves no trace] Profiling must not perturb training, or an ``auto`` partition
would break parity with the single-process run: gradients come from `torch.autograd.grad`
(parameters' ``.grad`` stay untouched), the RNG state is forked (dropout draws are undone) and
buffers such as running statistics are restored afterwards.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from polytrain.comm.agree import broadcast_ints, broadcast_text, is_main_rank
from polytrain.config.job import JobConfig
from polytrain.core.optim import build_optimizer
from polytrain.data.datasets import Dataset
from polytrain.errors import PartitionError
from polytrain.models.base import BlockModel, one_input
from polytrain.pipeline.checks import num_pipeline_stages
from polytrain.pipeline.partition import (
    BlockProfile,
    PartitionResult,
    check_counts,
    nearby_partitions,
    optimizer_state_factor,
    search_partition,
    uniform_counts,
)
from polytrain.pipeline.saved_tensors import count_saved_bytes, storage_keys

__all__ = [
    "OptimizerFactory",
    "check_partition",
    "choose_counts",
    "choose_partition",
    "leaves_no_trace",
    "profile_blocks",
    "profile_clock",
    "update_seconds",
]

_MIB = 1024.0 * 1024.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@contextmanager
def leaves_no_trace(model: nn.Module, device: torch.device) -> Iterator[None]:
    """[Note: profiling leaves no trace]: fork the RNG and put the buffers back afterwards."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for name, b in model.named_buffers():
                    b.copy_(buffers[name])


class _BlockRun:
    """Forward and backward of one block on a fixed input (plus the loss for the last block)."""

    def __init__(
        self,
        block: nn.Module,
        x: torch.Tensor,
        loss: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> None:
        self.block, self.x, self.loss = block, x, loss
        self.params = [p for p in block.parameters() if p.requires_grad]
        self.inputs = [x] if x.requires_grad else []
        self.out: torch.Tensor | None = None
        self.value: torch.Tensor | None = None

    def forward(self) -> None:
        out = self.block(self.x)
        self.out = out
        self.value = self.loss(out) if self.loss is not None else out

    def backward(self) -> None:
        assert self.value is not None
        wrt = self.inputs + self.params
        if wrt and self.value.requires_grad:
            torch.autograd.grad(self.value, wrt, grad_outputs=torch.ones_like(self.value))
        self.out = self.value = None


def profile_clock(device: torch.device) -> Callable[[], float]:
    """[Note: profile clock] On a CPU with one intra-op thread, the process's CPU time: it
    leaves out the time other processes on a shared machine take from us, which wall time
    would charge to whichever block was running. Otherwise (CUDA, or several threads whose CPU
    time would add up) the wall clock, synchronised around each measurement."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.process_time
    return time.perf_counter


def _median_times(
    runs: list[_BlockRun], device: torch.device, warmup: int, repeats: int
) -> list[tuple[float, float]]:
    """Median (forward, backward) seconds per block, timed in rounds over all blocks.

    Interleaving the blocks spreads any drift in the machine's load (other processes, clock
    changes) over every block alike, so it skews their ratios, which drive the search, less.
    """
    clock = profile_clock(device)
    forward: list[list[float]] = [[] for _ in runs]
    backward: list[list[float]] = [[] for _ in runs]
    for round_index in range(warmup + repeats):
        for k, run in enumerate(runs):
            _sync(device)
            t0 = clock()
            run.forward()
            _sync(device)
            t1 = clock()
            run.backward()
            _sync(device)
            t2 = clock()
            if round_index >= warmup:
                forward[k].append(t1 - t0)
                backward[k].append(t2 - t1)
    return [
        (statistics.median(f), statistics.median(b)) for f, b in zip(forward, backward, strict=True)
    ]


OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def update_seconds(
    parameters: Iterable[nn.Parameter],
    optimizer: OptimizerFactory,
    device: torch.device,
    warmup: int,
    repeats: int,
) -> float:
    """Median time of one optimizer step over copies of the trainable ``parameters``."""
    params = [nn.Parameter(p.detach().clone()) for p in parameters if p.requires_grad]
    if not params:
        return 0.0
    for p in params:
        p.grad = torch.ones_like(p)
    opt = optimizer(params)
    clock, times = profile_clock(device), []
    for i in range(warmup + repeats):
        _sync(device)
        t0 = clock()
        opt.step()
        _sync(device)
        if i >= warmup:
            times.append(clock() - t0)
    return statistics.median(times)


def profile_blocks(
    model: BlockModel,
    sample: tuple[torch.Tensor, torch.Tensor],
    *,
    warmup: int = 2,
    repeats: int = 5,
    optimizer_factor: int = 2,
    optimizer: OptimizerFactory | None = None,
) -> list[BlockProfile]:
    """Measure every block on one micro-batch ``sample = (inputs, targets)`` where it lives.

    Block ``i`` runs on the output of block ``i - 1`` (detached, so each block is timed alone);
    the last block's forward and backward include the loss, as on the last pipeline stage.
    Times are medians over ``repeats`` after ``warmup`` runs ([Note: profile clock]). ``optimizer_factor`` is the
    optimizer-state bytes per parameter byte (`optimizer_state_factor`: AdamW 2, SGD momentum 1,
    plain SGD 0). Activation bytes are the distinct storages autograd saves, parameters and
    buffers excluded, de-duplicated within a block (two adjacent blocks saving the same tensor
    count it twice, which is right when a stage boundary falls between them). With
    ``optimizer`` (params -> optimizer), each block's ``update_s`` is the median time of a step
    of that optimizer over copies of the block's parameters (not on the meta device).
    """
    if repeats < 1 or warmup < 0:
        raise PartitionError(f"profile repeats = {repeats}, warmup = {warmup}: need >= 1 and >= 0")
    inputs, targets = sample
    device = inputs.device
    static = storage_keys(model.parameters()) | storage_keys(model.buffers())
    runs: list[_BlockRun] = []
    sizes: list[tuple[int, int, int]] = []  # activation, input, output bytes
    x = inputs
    with leaves_no_trace(model, device):
        for index, block in enumerate(model.blocks):
            x_in = x.detach()
            if x_in.is_floating_point():
                x_in.requires_grad_(True)
            loss: Callable[[torch.Tensor], torch.Tensor] | None = None
            if index == len(model.blocks) - 1:

                def loss(out: torch.Tensor) -> torch.Tensor:
                    return model.loss(out, targets)

            run = _BlockRun(block, x_in, loss)
            with count_saved_bytes(static) as saved:
                run.forward()
            activation = saved.bytes
            assert run.out is not None
            out = run.out.detach()
            run.backward()
            runs.append(run)
            sizes.append((activation, _nbytes(x_in), _nbytes(out)))
            x = out
        times = _median_times(runs, device, warmup, repeats)
    profiles: list[BlockProfile] = []
    for block, (forward_s, backward_s), (activation, input_bytes, output_bytes) in zip(
        model.blocks, times, sizes, strict=True
    ):
        params = list(block.parameters())
        trainable = sum(_nbytes(p) for p in params if p.requires_grad)
        update_s = 0.0
        if optimizer is not None and device.type != "meta":
            update_s = update_seconds(params, optimizer, device, warmup, repeats)
        profiles.append(
            BlockProfile(
                forward_s=forward_s,
                backward_s=backward_s,
                param_count=sum(p.numel() for p in params),
                param_bytes=sum(_nbytes(p) for p in params),
                grad_bytes=trainable,
                optimizer_bytes=optimizer_factor * trainable,
                activation_bytes=activation,
                input_bytes=input_bytes,
                output_bytes=output_bytes,
                update_s=update_s,
            )
        )
    return profiles


def _profile(
    job: JobConfig, model: BlockModel, sample: tuple[torch.Tensor, torch.Tensor]
) -> list[BlockProfile]:
    return profile_blocks(
        model,
        sample,
        optimizer_factor=optimizer_state_factor(job.optim.name, job.optim.momentum),
        optimizer=partial(build_optimizer, cfg=job.optim),
    )


def _search_args(job: JobConfig) -> dict[str, Any]:
    limit_mb, m = job.pipeline.memory_limit_mb, job.pipeline.microbatches
    return {
        "schedule": job.pipeline.schedule,
        "num_microbatches": m,
        "memory_limit_bytes": limit_mb * _MIB if limit_mb > 0 else None,
        # 'ops' keeps the matmul outputs: priced here as if nothing were recomputed (an upper
        # bound on its memory) until the profile counts activations per op
        "recompute": job.parallel.recompute_policy.mode == "full",
        "recompute_every": job.parallel.recompute_policy.every,
        "update_every": m if job.pipeline.pipedream_update == "step" else 1,
    }


def _search(job: JobConfig, profiles: list[BlockProfile], num_stages: int) -> PartitionResult:
    return search_partition(profiles, num_stages, **_search_args(job))


Measure = Callable[[list[list[int]]], list[float]]
"""Seconds per step of each candidate partition, measured inside the pipeline (a collective)."""


def choose_partition(
    job: JobConfig,
    model: BlockModel,
    sample: tuple[torch.Tensor, torch.Tensor],
    num_stages: int,
    *,
    verbose: bool = False,
    measure: Measure | None = None,
) -> list[int]:
    """Blocks per stage for ``job.pipeline.partition`` (``uniform``, ``auto`` or a list).

    ``auto`` profiles ``model``'s blocks on ``sample`` (one micro-batch: per-replica batch /
    micro-batches rows) where it lives; see `choose_counts` for the collective.
    """
    return choose_counts(
        job,
        model.num_blocks,
        num_stages,
        partial(_profile, job, model, sample),
        verbose=verbose,
        measure=measure,
    )


def choose_counts(
    job: JobConfig,
    num_blocks: int,
    num_stages: int,
    profile: Callable[[], list[BlockProfile]],
    *,
    verbose: bool = False,
    measure: Measure | None = None,
) -> list[int]:
    """Units (blocks, or a user model's layers) per stage for ``job.pipeline.partition``.

    Collectives: none for ``uniform`` or an explicit list (pure functions of the config). For
    ``auto`` it is a collective over the default process group, so every rank must call it
    with the same ``num_stages``: global rank 0 runs ``profile()`` (one `BlockProfile` per
    unit) and searches, then broadcasts the counts as int64 tensors (and, if the search failed,
    its error message as bytes, so every rank raises the same `PartitionError`). Timings differ
    between ranks, so letting each rank search on its own could split the pipeline differently
    on different ranks. ``verbose`` prints the tables (pass it on global rank 0 only).

    [Note: partition trials] With ``measure`` and ``pipeline.partition_trials = k > 1``, rank 0
    also proposes up to ``k - 1`` neighbours of the optimum (`nearby_partitions`: one boundary
    moved by one or two blocks, the fastest predicted first), every rank times all ``k``
    inside the real pipeline (``measure``: each step starts after a barrier and counts until
    its slowest rank is done, so every rank sees the same numbers) and the fastest wins, the
    optimum on a tie. A profile
    of blocks alone misses what stages cost when they run side by side (shared caches, memory
    bandwidth and cores: on the partition benchmark the first stage's backward ran 1-2 ms per
    micro-batch slower inside the pipeline); the trials see it.
    """
    setting = job.pipeline.partition
    if isinstance(setting, list):
        per_rank = num_stages // job.parallel.pp
        return check_counts(setting, num_blocks, num_stages, stages_per_rank=per_rank)
    if setting == "uniform":
        return uniform_counts(num_blocks, num_stages)
    uniform_counts(num_blocks, num_stages)  # more stages than blocks: fail the same way everywhere
    trials = job.pipeline.partition_trials if measure is not None else 0
    candidates: list[list[int]] = []
    error = ""
    if is_main_rank():
        try:
            profiles = profile()
            result = _search(job, profiles, num_stages)
            candidates = [result.counts]
            if trials > 1:
                candidates = nearby_partitions(profiles, result.counts, trials, **_search_args(job))
            if verbose:
                print(result.table(), flush=True)
        except PartitionError as exc:
            error = str(exc)
    error = broadcast_text(error)
    if error:
        raise PartitionError(error)
    k = broadcast_ints([len(candidates)] if candidates else None, 1)[0]
    flat = broadcast_ints(
        [n for c in candidates for n in c] if candidates else None, k * num_stages
    )
    candidates = [
        check_counts(flat[i * num_stages : (i + 1) * num_stages], num_blocks, num_stages)
        for i in range(k)
    ]
    if k == 1 or measure is None:
        return candidates[0]
    times = measure(candidates)
    best = min(range(k), key=lambda i: (times[i], i))
    if verbose:
        rows = [f"  {c}: {t * 1e3:.1f} ms" for c, t in zip(candidates, times, strict=True)]
        print(
            f"partition trials (median step, slowest rank): chose {candidates[best]}\n"
            + "\n".join(rows),
            flush=True,
        )
    return candidates[best]


def check_partition(job: JobConfig, model: BlockModel, dataset: Dataset) -> None:
    """Pre-launch partition checks (no collectives, no timing): an explicit list must fit the
    model and ``parallel.pp``; ``auto`` with a memory limit must have a partition that fits.

    Memory does not depend on timings, so the second check profiles ``model`` where it lives,
    typically the meta device (shapes only, no arithmetic), on one micro-batch from
    ``dataset``. A model that cannot run on meta skips it; the workers check again.
    """
    setting, num_stages = job.pipeline.partition, num_pipeline_stages(job)
    if isinstance(setting, list):
        per_rank = num_stages // job.parallel.pp
        check_counts(setting, model.num_blocks, num_stages, stages_per_rank=per_rank)
        return
    if setting != "auto" or job.pipeline.memory_limit_mb <= 0 or num_stages < 2:
        return
    p, t = job.parallel, job.train
    rows = t.global_batch_size // (p.dp * t.grad_accum * job.pipeline.microbatches)
    device = next(model.parameters()).device
    inputs, targets = dataset.get(torch.arange(min(rows, len(dataset))))
    sample = (one_input(inputs).to(device), targets.to(device))
    try:
        profiles = profile_blocks(
            model,
            sample,
            warmup=0,
            repeats=1,
            optimizer_factor=optimizer_state_factor(job.optim.name, job.optim.momentum),
        )
    except (NotImplementedError, RuntimeError):
        return
    _search(job, profiles, num_stages)

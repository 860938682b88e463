"""The training loop: build everything for this rank, run the steps, log, export.

`train` runs inside one worker process (started by the elastic agent, the test harness, or a
plain ``python`` for a one-rank job). It returns the final metrics; rank 0 also returns the full
weights.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from polytrain.comm.collectives import barrier
from polytrain.comm.init import DistContext, init_distributed
from polytrain.comm.watchdog import Watchdog, collective_timeout_s
from polytrain.config.base import to_dict
from polytrain.config.job import JobConfig
from polytrain.core.optim import lr_at
from polytrain.core.strategy import StepOutput, Strategy
from polytrain.data.datasets import build_datasets
from polytrain.data.sampler import Batches
from polytrain.errors import ConfigError
from polytrain.measure.mfu import mfu_inputs
from polytrain.models.gpt import generate
from polytrain.models.pretrained import load_pretrained
from polytrain.models.registry import block_size_of, build_model
from polytrain.observe.metrics import (
    MetricsWriter,
    StateBytesAtUpdate,
    compile_seconds,
    model_state_bytes,
    peak_memory_mb,
)
from polytrain.observe.trace import merge_traces
from polytrain.observe.trackers import open_trackers
from polytrain.trainer.build import build_strategy
from polytrain.trainer.checkpoint import Checkpointer, restart_count
from polytrain.trainer.export import save_weights
from polytrain.trainer.outputs import publish_new
from polytrain.trainer.results import PendingResults
from polytrain.trainer.resume_checks import check_same_job

__all__ = ["TrainResult", "train"]


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    val_loss: float
    strategy: str
    history: list[dict[str, Any]] = field(default_factory=list)
    state_dict: dict[str, torch.Tensor] | None = None  # rank 0 only, the model's own names
    # rank 0 only: the same tensors under the user's own names (what --save-final exports and
    # what the user's class loads; a built-in's names are unchanged)
    exported: dict[str, torch.Tensor] | None = None
    sample: str = ""
    start_step: int = 0  # > 0 when resumed from a checkpoint


def _progress(console: Console, enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[speed]}"),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled,
        transient=False,
    )


def _write_rank_summary(
    out_dir: Path,
    rank: int,
    strategy: Strategy,
    history: list[dict[str, Any]],
    peak_mb: float,
    at_update: dict[str, int],
    compiled: bool = False,
) -> None:
    """``rank-<r>.json``: what this rank held and how long its steps took, for the planner's
    validation (`polytrain plan --validate`) to set against its predictions. Written before
    the final export, which gathers full weights and would raise the peak."""
    step_times = [r["step_time_s"] for r in history]
    times = sorted(step_times[1:] if compiled else step_times)  # [Note: compile time]
    summary: dict[str, Any] = {
        "rank": rank,
        "strategy": strategy.name,
        "peak_memory_mb": peak_mb,
        "state_bytes": model_state_bytes(strategy.modules, strategy.optimizer),
        # held just before the last step's update ([Note: model states at the update]);
        # {} where this rank runs no optimizer (a parameter-server worker)
        "state_bytes_at_update": at_update,
        "median_step_time_s": times[len(times) // 2] if times else None,
        "step_times_s": step_times,
    }
    if compiled:
        summary["compile_s"] = compile_seconds(step_times)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(summary, sort_keys=True))


def train(job: JobConfig, *, ctx: DistContext | None = None) -> TrainResult:
    if job.observe.trackers and not job.observe.out_dir:
        raise ConfigError(
            f"observe.trackers = {job.observe.trackers!r} write into the run directory, and "
            "observe.out_dir is empty: set it (polytrain.run sets one)"
        )
    ctx = ctx or init_distributed(
        device=job.train.device,
        backend=job.launch.backend,
        # Leaves the watchdog's grace period inside launch.timeout_s ([Note: hang diagnosis]).
        timeout_s=collective_timeout_s(job.launch.timeout_s),
    )
    watchdog = Watchdog(job.launch.timeout_s)
    with watchdog.guard("the start-up check that all ranks run the same job"):
        check_same_job(job, ctx.world_size)
    block_size = block_size_of(job.model)
    train_set, val_set, spec = build_datasets(job.data, block_size)
    batches = Batches(train_set, val_set, job.train.global_batch_size, job.train.seed)
    model = build_model(job.model, spec, job.train.seed)
    if job.model.init_from:  # before any strategy shards or splits the model
        load_pretrained(model, job.model.init_from)
    strategy = build_strategy(job, ctx, model, batches)
    checkpointer = None
    start = 0
    if job.checkpoint.dir:
        checkpointer = Checkpointer(job, strategy, ctx.rank, ctx.world_size)
        if job.checkpoint.resume or restart_count() > 0:
            with watchdog.guard("restoring the newest checkpoint"):
                start = checkpointer.restore()

    out_dir = Path(job.observe.out_dir) if job.observe.out_dir else None
    console = Console(stderr=False)
    samples_per_step = job.train.global_batch_size
    tokens_per_sample = block_size if spec.kind == "tokens" else 1
    flops, peak = mfu_inputs(job, ctx.device, spec, train_set)

    history: list[dict[str, Any]] = []
    loss = val_loss = float("nan")
    steps = job.train.steps
    show = ctx.is_main and job.observe.progress
    every = job.train.eval_every

    def evaluation_due(step: int) -> bool:
        return step + 1 == steps or bool(every and (step + 1) % every == 0)

    def checkpoint_due(step: int) -> bool:
        return checkpointer is not None and checkpointer.due(step + 1)

    at_update = StateBytesAtUpdate(strategy.modules, strategy.optimizer)
    rank0_dir = out_dir if ctx.is_main else None
    metrics = MetricsWriter(
        rank0_dir / "metrics.jsonl" if rank0_dir else None,
        open_trackers(job.observe.trackers, rank0_dir, to_dict(job)) if rank0_dir else (),
    )
    # The writer closes first on leaving, so its trackers' runs end (failed, when the steps
    # raised) whatever the progress bar and the checkpointer's guard do after.
    with _progress(console, show) as progress, Checkpointer.guard(checkpointer), metrics:
        task = progress.add_task(strategy.name, total=steps, loss="-", speed="", completed=start)

        def record_step(step: int, out: StepOutput, step_time: float) -> None:
            """Record step ``step`` (0-based, its result read), then evaluate and checkpoint
            when due."""
            nonlocal loss, val_loss
            loss = out.loss
            record: dict[str, Any] = {
                "step": step + 1,
                "loss": loss,
                "lr": lr_at(step, job.optim, steps),
                "step_time_s": step_time,
                "samples_per_s": samples_per_step / step_time,
                "strategy": strategy.name,
            }
            if spec.kind == "tokens":
                record["tokens_per_s"] = samples_per_step * tokens_per_sample / step_time
            if peak:
                record["mfu"] = flops * samples_per_step / step_time / (peak * ctx.world_size)
            if out.skipped:
                record["skipped"] = True
            record.update(out.metrics)
            if evaluation_due(step):
                with watchdog.guard(f"the evaluation after step {step + 1}"):
                    val_loss = strategy.evaluate(job.train.eval_batches)
                if strategy.evaluates:  # a rank without a replica (a server) has no loss to log
                    record["val_loss"] = val_loss
                    record.update(strategy.evaluation_metrics())
            if step + 1 == steps or (step + 1) % job.observe.log_every == 0 or "val_loss" in record:
                record["memory_mb"] = peak_memory_mb(ctx.device)
                if job.train.compile and history and "compile_s" not in history[0]:
                    times = [r["step_time_s"] for r in history] + [step_time]
                    history[0]["compile_s"] = record["compile_s"] = compile_seconds(times)
                metrics.write(record)
            history.append(record)
            speed = (
                f"{record['tokens_per_s']:.0f} tok/s"
                if "tokens_per_s" in record
                else f"{record['samples_per_s']:.0f} samples/s"
            )
            progress.update(task, advance=1, loss=f"{loss:.4f}", speed=speed)
            if checkpointer is not None and checkpoint_due(step):
                with watchdog.guard(f"the checkpoint save after step {step + 1}"):
                    checkpointer.save(step + 1)

        def read(keep_newest: bool = False) -> None:
            for done in pending.read(watchdog.guard, keep_newest=keep_newest):
                record_step(done.step, done.out, done.step_time_s)
            pending.restart_window()

        # [Note: reading results late] in trainer/results.py: results are read when logged.
        pending = PendingResults(ctx.device, stop=job.train.on_nonfinite == "stop")
        for step in range(start, steps):
            if step == steps - 1 and out_dir is not None:
                at_update.arm()
            strategy.set_lr(lr_at(step, job.optim, steps))
            watchdog.check_in(step)
            t0 = time.perf_counter()
            with watchdog.guard(f"train step {step + 1} of {strategy.name}"):
                out = strategy.train_step(step)
            pending.add(step, out, time.perf_counter() - t0)
            logged = (step + 1) % job.observe.log_every == 0
            if (
                out.complete is None
                or step == start  # its own window: warm-up and compilation ([Note: compile time])
                or logged
                or step + 1 == steps
                or evaluation_due(step)
                or checkpoint_due(step)
                or pending.stop_seen()
            ):
                read()
            elif pending.unread_without_flag():  # [Note: deferred step results]
                read(keep_newest=True)

    at_update.close()
    if out_dir is not None:
        peak_mb = peak_memory_mb(ctx.device)
        _write_rank_summary(
            out_dir, ctx.rank, strategy, history, peak_mb, at_update.reading, job.train.compile
        )
    if job.observe.trace:
        # Parts go to the run directory (ours, locked), the merged trace to the user's path
        # without replacing anything there ([Note: output paths] in trainer/outputs.py).
        prefix = out_dir / "trace" if out_dir is not None else Path(f"{job.observe.trace}.part")
        strategy.tracer.write_part(prefix)
        barrier()
        if ctx.is_main:
            text = merge_traces(prefix, ctx.world_size)
            publish_new(job.observe.trace, lambda tmp: tmp.write_text(text))
    state = strategy.full_state_dict()
    result = TrainResult(steps, loss, val_loss, strategy.name, history, start_step=start)
    if ctx.is_main:
        result.state_dict = state
        result.exported = model.export_state(state)
        if job.checkpoint.save_final:
            save_weights(model.export_state(state), job.checkpoint.save_final)
        if job.model.name == "gpt" and job.train.sample_tokens:
            sample_model = build_model(job.model, spec, job.train.seed)
            sample_model.load_state_dict(state)
            prompt = torch.zeros((1, 1), dtype=torch.long)
            ids = generate(
                sample_model, prompt, job.train.sample_tokens, block_size, job.train.seed
            )
            result.sample = spec.decode(ids[0, 1:].tolist())
    # A strategy that survives dead ranks (parameter servers in async/ssp) declares it meets
    # the world in no collective ([Note: no world collectives] in polytrain.ps.strategy).
    if strategy.world_collectives:
        barrier()
    return result

"""``polytrain train``: flags are views of `JobConfig` fields (contract 2).

A flag left out keeps the value from ``--config`` (or the default); ``--set section.key=value``
reaches every field. The job is validated here, before any process starts, then launched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import tomli_w
import typer

from polytrain.api import prepare, run
from polytrain.config.base import to_dict
from polytrain.config.io import job_from_dict, load_job, merge, parse_override
from polytrain.config.job import JobConfig
from polytrain.errors import ConfigError

__all__ = ["resolve_job", "train_command"]

# flag name -> config path; the flag's value (when given) overrides that field.
FLAG_FIELDS: dict[str, str] = {
    "strategy": "strategy",
    "model": "model.name",
    "size": "model.size",
    "data": "data.source",
    "steps": "train.steps",
    "batch_size": "train.global_batch_size",
    "grad_accum": "train.grad_accum",
    "seed": "train.seed",
    "dtype": "train.dtype",
    "device": "train.device",
    "eval_every": "train.eval_every",
    "optimizer": "optim.name",
    "lr": "optim.lr",
    "momentum": "optim.momentum",
    "nproc": "launch.nproc",
    "nnodes": "launch.nnodes",
    "node_rank": "launch.node_rank",
    "rdzv_endpoint": "launch.rdzv_endpoint",
    "max_restarts": "launch.max_restarts",
    "timeout": "launch.timeout_s",
    "dp": "parallel.dp",
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "zero": "parallel.zero",
    "sync": "parallel.sync",
    "bucket_mb": "parallel.bucket_mb",
    "grad_compression": "parallel.grad_compression",
    "sufficient_factor": "parallel.sufficient_factor",
    "recompute": "parallel.recompute",
    "schedule": "pipeline.schedule",
    "microbatches": "pipeline.microbatches",
    "partition": "pipeline.partition",
    "memory_limit_mb": "pipeline.memory_limit_mb",
    "ps_servers": "ps.servers",
    "ps_mode": "ps.mode",
    "staleness": "ps.staleness",
    "checkpoint_dir": "checkpoint.dir",
    "checkpoint_every": "checkpoint.every",
    "checkpoint_keep": "checkpoint.keep",
    "async_save": "checkpoint.async_save",
    "resume": "checkpoint.resume",
    "save_final": "checkpoint.save_final",
    "out_dir": "observe.out_dir",
    "trace": "observe.trace",
    "progress": "observe.progress",
}


def _partition_value(text: str) -> Any:
    """``auto`` / ``uniform`` stay strings; ``3,5`` or ``[3, 5]`` become a list of ints."""
    stripped = text.strip().strip("[]")
    if stripped in ("auto", "uniform"):
        return stripped
    try:
        return [int(part) for part in stripped.split(",")]
    except ValueError:
        raise ConfigError(
            f"--partition {text!r}: expected auto, uniform or block counts such as 3,5"
        ) from None


def resolve_job(config: Path | None, flags: dict[str, Any], overrides: list[str]) -> JobConfig:
    """Config file, then flags, then ``--set`` overrides, validated as one `JobConfig`."""
    data: dict[str, Any] = load_job(config) if config else {}
    for name, value in flags.items():
        if value is None:
            continue
        if name == "partition":
            value = _partition_value(value)
        merge(data, FLAG_FIELDS[name].split("."), value)
    for text in overrides:
        path, value = parse_override(text)
        merge(data, path, value)
    return job_from_dict(data)


def _describe(overrides: dict[str, Any]) -> str:
    return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in overrides.items() if k != "launch.nproc")


def _plan_first(job: JobConfig) -> JobConfig:
    """``--strategy auto``: say what the planner chose and why, then run that."""
    from polytrain.trainer.auto import resolve_auto

    choice = resolve_auto(job)
    p = choice.prediction
    source = (
        "this host's calibrated profile"
        if choice.profiled
        else ("catalog figures (run `polytrain calibrate` for measured ones)")
    )
    typer.echo(
        f"polytrain: planner chose {_describe(choice.layout.overrides())} on "
        f"{choice.layout.devices} "
        f"process(es): predicted {p.step_s * 1e3:.1f} ms/step, "
        f"{p.memory_per_rank / 2**20:.0f} MiB per rank ({source})"
    )
    return choice.job


def train_command(
    config: Annotated[Path | None, typer.Option(help="TOML job file")] = None,
    strategy: Annotated[
        str | None, typer.Option(help="manual, or auto: the planner picks the layout")
    ] = None,
    model: Annotated[str | None, typer.Option(help="gpt, mlp or package.module:factory")] = None,
    size: Annotated[str | None, typer.Option(help="tiny, small or medium")] = None,
    data: Annotated[
        str | None, typer.Option(help="pydoc, or a .txt/.npy/.safetensors path")
    ] = None,
    steps: Annotated[int | None, typer.Option(help="optimizer steps")] = None,
    batch_size: Annotated[int | None, typer.Option(help="global batch size")] = None,
    grad_accum: Annotated[int | None, typer.Option(help="accumulation micro-steps")] = None,
    seed: Annotated[int | None, typer.Option(help="seed of weights and batch order")] = None,
    dtype: Annotated[str | None, typer.Option(help="fp32 or bf16 autocast")] = None,
    device: Annotated[str | None, typer.Option(help="cpu, cuda or auto")] = None,
    eval_every: Annotated[int | None, typer.Option(help="validation every N steps")] = None,
    optimizer: Annotated[str | None, typer.Option(help="adamw or sgd")] = None,
    lr: Annotated[float | None, typer.Option(help="peak learning rate")] = None,
    momentum: Annotated[float | None, typer.Option(help="SGD momentum")] = None,
    nproc: Annotated[int | None, typer.Option(help="worker processes on this node")] = None,
    nnodes: Annotated[int | None, typer.Option(help="number of nodes")] = None,
    node_rank: Annotated[int | None, typer.Option(help="rank of this node")] = None,
    rdzv_endpoint: Annotated[str | None, typer.Option(help="HOST:PORT (multi-node)")] = None,
    max_restarts: Annotated[int | None, typer.Option(help="worker-group restarts")] = None,
    timeout: Annotated[float | None, typer.Option(help="collective timeout, seconds")] = None,
    dp: Annotated[int | None, typer.Option(help="data-parallel degree")] = None,
    tp: Annotated[int | None, typer.Option(help="tensor-parallel degree")] = None,
    pp: Annotated[int | None, typer.Option(help="pipeline stages")] = None,
    zero: Annotated[int | None, typer.Option(help="ZeRO stage: 0, 2 or 3")] = None,
    sync: Annotated[str | None, typer.Option(help="allreduce or ps")] = None,
    bucket_mb: Annotated[float | None, typer.Option(help="DDP bucket size, MiB")] = None,
    grad_compression: Annotated[str | None, typer.Option(help="none, bf16 or fp16")] = None,
    sufficient_factor: Annotated[str | None, typer.Option(help="auto, on or off")] = None,
    recompute: Annotated[bool | None, typer.Option(help="recompute activations")] = None,
    schedule: Annotated[str | None, typer.Option(help="gpipe, 1f1b or pipedream")] = None,
    microbatches: Annotated[int | None, typer.Option(help="pipeline micro-batches")] = None,
    partition: Annotated[str | None, typer.Option(help="auto, uniform or 3,5")] = None,
    memory_limit_mb: Annotated[
        float | None, typer.Option(help="per-stage memory limit for --partition auto, MiB")
    ] = None,
    ps_servers: Annotated[int | None, typer.Option(help="parameter-server ranks")] = None,
    ps_mode: Annotated[str | None, typer.Option(help="sync, async or ssp")] = None,
    staleness: Annotated[int | None, typer.Option(help="ssp staleness bound")] = None,
    checkpoint_dir: Annotated[str | None, typer.Option(help="checkpoint directory")] = None,
    checkpoint_every: Annotated[int | None, typer.Option(help="save every N steps")] = None,
    checkpoint_keep: Annotated[int | None, typer.Option(help="keep the newest K")] = None,
    async_save: Annotated[bool | None, typer.Option(help="write checkpoints in background")] = None,
    resume: Annotated[bool | None, typer.Option(help="resume from the newest checkpoint")] = None,
    save_final: Annotated[str | None, typer.Option(help="final weights .safetensors")] = None,
    out_dir: Annotated[str | None, typer.Option(help="run directory (metrics, logs)")] = None,
    trace: Annotated[str | None, typer.Option(help="Chrome trace output path")] = None,
    progress: Annotated[bool | None, typer.Option(help="progress bar on rank 0")] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="section.key=value (repeatable)")
    ] = None,
    dry_run: Annotated[bool, typer.Option(help="validate and print the job, do not run")] = False,
) -> None:
    """Train a model; with no arguments, the default job (gpt tiny, 2 CPU workers, DP)."""
    flags = {name: value for name, value in locals().items() if name in FLAG_FIELDS}
    job = resolve_job(config, flags, set_ or [])
    if job.strategy == "auto":
        job = _plan_first(job)
    job = prepare(job)
    if dry_run:
        typer.echo(tomli_w.dumps(to_dict(job)))
        return
    typer.echo(
        f"polytrain: {job.launch.nproc} worker(s) on this node, {job.world_size} rank(s) in "
        f"all, run dir {job.observe.out_dir}"
    )
    run(job)

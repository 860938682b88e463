"""``polytrain train``: flags are views of `JobConfig` fields (contract 2).

A flag left out keeps the value from ``--config`` (or the default); ``--set section.key=value``
reaches every field. The job is validated here, before any process starts, then launched.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, Union, cast, get_args, get_origin

import tomli_w
import torch
import typer

from polytrain.api import prepare, run
from polytrain.comm.init import resolve_backend
from polytrain.config.base import FieldInfo, describe_field, to_dict
from polytrain.config.io import job_from_dict, load_job, merge, parse_override
from polytrain.config.job import JobConfig
from polytrain.errors import ConfigError
from polytrain.trainer.auto import predict_job, resolve_auto
from polytrain.trainer.build import FAMILIES

__all__ = ["resolve_job", "train_command"]

# flag name -> config path; the flag's value (when given) overrides that field. The options of
# the job as a whole; each strategy family adds its own (`StrategyFamily.flags`), below.
_JOB_FLAGS: dict[str, str] = {
    "strategy": "strategy",
    "model": "model.name",
    "size": "model.size",
    "data": "data.source",
    "tokenizer": "data.tokenizer",
    "init_from": "model.init_from",
    "steps": "train.steps",
    "batch_size": "train.global_batch_size",
    "grad_accum": "train.grad_accum",
    "seed": "train.seed",
    "dtype": "train.dtype",
    "device": "train.device",
    "eval_every": "train.eval_every",
    "compile": "train.compile",
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
    "hierarchical": "parallel.hierarchical",
    "checkpoint_dir": "checkpoint.dir",
    "checkpoint_every": "checkpoint.every",
    "checkpoint_keep": "checkpoint.keep",
    "async_save": "checkpoint.async_save",
    "resume": "checkpoint.resume",
    "save_final": "checkpoint.save_final",
    "out_dir": "observe.out_dir",
    "trace": "observe.trace",
    "progress": "observe.progress",
    "trackers": "observe.trackers",
}
_FAMILY_FLAGS = {flag: path for family in FAMILIES for flag, path in family.flags.items()}
FLAG_FIELDS: dict[str, str] = {**_JOB_FLAGS, **_FAMILY_FLAGS}


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


def _names_value(text: str) -> list[str]:
    """``tensorboard,mlflow`` -> ``["tensorboard", "mlflow"]``; ``''`` is the empty list (the
    config checks the names)."""
    return [part.strip() for part in text.split(",") if part.strip()]


def _count_value(text: str) -> Any:
    """``--nproc 4`` is a count; a word (``gpu``, ``auto``, ``host``) stays text for the config
    to check."""
    stripped = text.strip()
    return int(stripped) if stripped.isdigit() else stripped


def _is_count_or_word(path: str) -> bool:
    """A field typed ``int | Literal[...]`` (``launch.nproc``, ``ps.leaves``): its flag's text
    is a count when it is digits, else a word."""
    tp = describe_field(JobConfig, path).type
    args = get_args(tp) if get_origin(tp) in (Union, types.UnionType) else ()
    return int in args and any(get_origin(a) is Literal for a in args)


_COUNT_OR_WORD = {name for name, path in FLAG_FIELDS.items() if _is_count_or_word(path)}


def resolve_job(config: Path | None, flags: dict[str, Any], overrides: list[str]) -> JobConfig:
    """Config file, then flags, then ``--set`` overrides, validated as one `JobConfig`."""
    data: dict[str, Any] = load_job(config) if config else {}
    out_dir = data.get("observe", {}).get("out_dir", "")
    if config and out_dir and Path(out_dir).resolve() == config.resolve().parent:
        # A run's own resolved job.toml names the run's directory, which already holds that
        # run: running the file again is a new run, in a new directory (or --out-dir).
        del data["observe"]["out_dir"]
    for name, value in flags.items():
        if value is None:
            continue
        if name == "partition":
            value = _partition_value(value)
        elif name in _COUNT_OR_WORD:
            value = _count_value(value)
        elif name == "trackers":
            value = _names_value(value)
        merge(data, FLAG_FIELDS[name].split("."), value)
    for text in overrides:
        path, value = parse_override(text)
        merge(data, path, value)
    return job_from_dict(data)


_KEYWORD = inspect.Parameter.KEYWORD_ONLY


def _flag_type(tp: Any) -> type:
    """The command-line type of a field annotated ``tp``: its first non-None alternative, with
    ``Literal`` choices and lists (``pipeline.partition``), and a count or a word
    (``launch.nproc``), read as text and checked by the config, so a bad value gets the
    config's one-line error."""
    if get_origin(tp) in (Union, types.UnionType):
        options = [a for a in get_args(tp) if a is not type(None)]
        if any(get_origin(a) is Literal for a in options):
            return str
        tp = options[0]
    if get_origin(tp) in (Literal, list):
        return str
    assert tp in (int, float, bool, str), f"no command-line type for {tp!r}"
    return cast(type, tp)


def _flag_help(info: FieldInfo) -> str:
    """The field's own help, its choices, and where it lives: ``optimizer steps (train.steps,
    default 1200)``."""
    text = info.help
    tp = info.type
    if get_origin(tp) in (Union, types.UnionType):
        tp = next(a for a in get_args(tp) if a is not type(None))
    if get_origin(tp) is Literal:
        text += f": {' | '.join(str(c) for c in get_args(tp))}"
    default = info.default
    if isinstance(default, bool):
        default = str(default).lower()
    shown = "''" if default == "" else default
    # Round brackets: typer renders help as rich markup, where [...] would be a style tag.
    return f"{text} ({info.path}, default {shown})"


def _flag_parameter(name: str, path: str) -> inspect.Parameter:
    info = describe_field(JobConfig, path)
    option = typer.Option(help=_flag_help(info), show_default=False)
    annotation = Annotated[_flag_type(info.type) | None, option]  # type: ignore[valid-type]
    return inspect.Parameter(name, _KEYWORD, default=None, annotation=annotation)


def _describe(overrides: dict[str, Any]) -> str:
    return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in overrides.items() if k != "launch.nproc")


def _plan_first(job: JobConfig) -> JobConfig:
    """``--strategy auto``: say what the planner chose and why, then run that."""
    choice = resolve_auto(job)
    p = choice.prediction
    source = (
        "this host's calibrated profile"
        if choice.profiled
        else "catalog figures (run `polytrain calibrate` for measured ones)"
    )
    typer.echo(
        f"polytrain: planner chose {_describe(choice.layout.overrides())} on "
        f"{choice.layout.devices} process(es): predicted {p.step_s * 1e3:.1f} ms/step, "
        f"{p.memory_per_rank / 2**20:.0f} MiB per rank ({source})"
    )
    return choice.job


def _summary(job: JobConfig) -> str:
    """`--dry-run`'s first lines: the model's size, the world, the layout, and the planner's
    step time and memory per rank for it on this host (as TOML comments)."""
    estimate = predict_job(job)
    p = job.parallel
    layout = estimate.layout.describe() if estimate.layout else f"sync {p.sync}, pp {p.pp}"
    lines = [
        f"# {job.model.name}: {estimate.params / 1e6:,.2f} M parameters; {job.world_size} "
        f"rank(s) on {job.train.device} ({job.launch.num_procs} per node); layout {layout}"
    ]
    pred = estimate.prediction
    if pred is None:
        lines.append("# predicted: not priced (a layout or device the planner has no model for)")
    else:
        source = "this host's calibrated profile" if estimate.profiled else "catalog figures"
        lines.append(
            f"# predicted: {pred.step_s * 1e3:.1f} ms/step, {pred.memory_per_rank / 2**20:,.0f} "
            f"MiB per rank ({source}{'' if pred.fits else '; ' + pred.why})"
        )
    return "\n".join(lines)


def _devices(job: JobConfig) -> str:
    """What this node's workers run on, as resolved ([Note: device resolution]):
    ``2 x cuda (NVIDIA H200), nccl`` or ``2 CPU processes, gloo``."""
    n = job.launch.num_procs
    backend = resolve_backend(job.launch.backend, job.train.device)
    if job.train.device == "cuda":
        return f"{n} x cuda ({torch.cuda.get_device_name(0)}), {backend}"
    return f"{n} CPU process{'es' if n != 1 else ''}, {backend}"


def _train(
    config: Annotated[Path | None, typer.Option(help="TOML job file")] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="section.key=value (repeatable)")
    ] = None,
    dry_run: Annotated[bool, typer.Option(help="validate and print the job, do not run")] = False,
    **flags: Any,
) -> None:
    """Train a model; with no arguments, the default job (gpt tiny, data parallel on every GPU
    with NCCL, or on 2 CPU workers with gloo where there is no GPU)."""
    job = resolve_job(config, flags, set_ or [])
    if job.strategy == "auto":
        job = _plan_first(job)
    job = prepare(job)
    if job.parallel.pp > 1 and job.pipeline.microbatches < job.parallel.pp:
        p, m = job.parallel.pp, job.pipeline.microbatches
        typer.echo(
            f"polytrain: note: {m} micro-batch(es) through {p} stages leaves each stage idle "
            f"{(p - 1) / (m + p - 1):.0%} of the step; --microbatches {4 * p} (a divisor of "
            "the batch per replica) fills the pipeline",
            err=True,
        )
    if dry_run:
        typer.echo(_summary(job))
        typer.echo(tomli_w.dumps(to_dict(job)))
        return
    typer.echo(
        f"polytrain: {_devices(job)} on this node, {job.world_size} rank(s) in all, "
        f"run dir {job.observe.out_dir}"
    )
    run(job)


def _command() -> Callable[..., None]:
    """`_train` with one keyword option per `FLAG_FIELDS` entry, its help taken from the config
    field (contract 2: the flags are views of the fields, described once)."""
    fixed = {
        name: p.replace(kind=_KEYWORD)
        for name, p in inspect.signature(_train, eval_str=True).parameters.items()
    }
    params = [fixed["config"]]
    params += [_flag_parameter(name, path) for name, path in FLAG_FIELDS.items()]
    params += [fixed["set_"], fixed["dry_run"]]

    def train_command(**kwargs: Any) -> None:
        """Train a model; with no arguments, the default job (gpt tiny, data parallel on every
        GPU with NCCL, or on 2 CPU workers with gloo where there is no GPU)."""
        _train(**kwargs)

    train_command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    train_command.__annotations__ = {p.name: p.annotation for p in params}
    return train_command


train_command = _command()

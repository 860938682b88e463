"""``polytrain plan --layout SPEC`` and ``--as-written``: price one given layout, with its parts.

A user asks "what about the layout I run today?": ``--layout "dp=8,zero=3,recompute=every:2"``
names it in the planner's words (each key is a job field, listed in `LAYOUT_KEYS`), and the
answer is the cost model's step time split into its parts (compute, tensor-parallel
collectives, the exposed data-parallel synchronization, the pipeline bubble, the optimizer, the
framework's own loop) and the busiest rank's memory by kind (weights, gradients, optimizer
state, activations, buffers). ``--as-written`` prices the job's own ``parallel``, ``pipeline``
and ``ps`` sections the same way.
"""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from polytrain.config.job import JobConfig
from polytrain.errors import PlanError
from polytrain.pipeline.schedule import zero_stages_problem
from polytrain.planner.cluster import Cluster
from polytrain.planner.cost import Env, predict
from polytrain.planner.search import PlanRequest
from polytrain.planner.types import ModelStats, Prediction
from polytrain.trainer.auto import layout_of

__all__ = ["LAYOUT_KEYS", "layout_overrides", "price_as_written"]

LAYOUT_KEYS = {
    "dp": "parallel.dp",
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "zero": "parallel.zero",
    "sync": "parallel.sync",
    "recompute": "parallel.recompute",
    "schedule": "pipeline.schedule",
    "micro": "pipeline.microbatches",
    "v": "pipeline.virtual_stages",
    "accum": "train.grad_accum",
    "servers": "ps.servers",
    "mode": "ps.mode",
}
"""``--layout`` keys and the job fields they set; the values are those fields' values."""

_DEGREES = ("dp", "tp", "pp")

# the parts of a step, in the order a reader follows one, with what each is
_TIME_PARTS = {
    "compute": "forward and backward compute",
    "tp_comm": "tensor-parallel collectives",
    "dp_comm": "data-parallel synchronization, exposed",
    "late_multiply": "sufficient factors' late multiply",
    "fsdp_hooks": "FSDP2's hooks",
    "bubble": "pipeline bubble",
    "pipeline_runtime": "pipeline runtime's own work",
    "optimizer": "optimizer step",
    "loop": "training loop's own work",
    "skew": "waiting for the slowest rank",
}
_MEMORY_PARTS = ("weights", "grads", "optimizer", "activations", "buffers")


def layout_overrides(text: str) -> list[str]:
    """``--set`` overrides of ``--layout`` ``text`` ("dp=8,tp=2,zero=3"), with the process
    count the layout needs (dp x tp x pp, plus a parameter server's server ranks).

    Degrees not named are 1; "recompute=selective" is the job's "ops" policy."""
    pairs: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        key, sep, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep or not value or key not in LAYOUT_KEYS:
            raise PlanError(
                f"--layout {text!r}: {item!r} is not KEY=VALUE with a key of "
                f"{', '.join(LAYOUT_KEYS)} (e.g. --layout 'dp=8,zero=3')"
            )
        pairs[key] = value
    degrees = []
    for key in _DEGREES:
        value = pairs.setdefault(key, "1")
        if not value.isdigit() or int(value) < 1:
            raise PlanError(f"--layout {text!r}: {key}={value} is not a positive integer")
        degrees.append(int(value))
    if pairs.get("recompute", "").lower() == "selective":
        pairs["recompute"] = "ops"
    ranks = degrees[0] * degrees[1] * degrees[2]
    if pairs.get("sync") == "ps":
        servers = pairs.get("servers", "1")
        if not servers.isdigit():
            raise PlanError(f"--layout {text!r}: servers={servers} is not a count")
        ranks += int(servers)
    sets = [f"{LAYOUT_KEYS[key]}={value}" for key, value in pairs.items()]
    return [*sets, f"launch.nproc={ranks}", "launch.nnodes=1"]


def _gib(nbytes: float) -> str:
    if nbytes < 2**30:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / 2**30:.2f} GiB"


def price_as_written(
    job: JobConfig, stats: ModelStats, clu: Cluster, request: PlanRequest, json_: bool
) -> Prediction:
    """The cost model's step time and memory for the job's own layout, printed with its parts."""
    layout = layout_of(job)
    if layout is None:
        raise PlanError(
            "plan: the planner has no model for this layout (hybrid or spatial parallelism, "
            "hierarchical parameter servers): price the nearest it has, e.g. --layout "
            "'dp=4,zero=3' or sync=ps with servers=K"
        )
    zero = zero_stages_problem(layout.zero, layout.schedule, layout.tp, layout.pp)
    if zero is not None:  # [Note: tensor-parallel ZeRO stages] in planner/cost/zero_stages.py
        raise PlanError(f"plan: layout {layout.describe()}: {zero}")
    if layout.devices > clu.size:
        raise PlanError(
            f"plan: layout {layout.describe()} needs {layout.devices} devices and the cluster "
            f"{clu.describe()} has {clu.size}: give a larger --cluster"
        )
    env = Env(clu.with_size(layout.devices), job.train.dtype, request.profile, request.bucket_bytes)
    pred = predict(layout, stats, env, job.train.global_batch_size)
    if json_:
        out = {
            "layout": pred.layout.describe(),
            "devices": layout.devices,
            "step_s": pred.step_s,
            "memory_per_rank": pred.memory_per_rank,
            "fits": pred.fits,
            "why": pred.why,
            "breakdown": pred.breakdown,
        }
        typer.echo(json.dumps(out, indent=2))
        return pred
    fits = "fits" if pred.fits else pred.why
    console = Console(width=None if Console().is_terminal else 120)
    console.print(
        f"{stats.name}, {pred.layout.describe()} on {layout.devices} x {clu.device.key}: "
        f"{pred.step_s * 1e3:.1f} ms/step, {_gib(pred.memory_per_rank)} on the busiest rank "
        f"({fits})",
        highlight=False,
    )
    console.print(_parts_table(pred))
    return pred


def _parts_table(pred: Prediction) -> Table:
    b = pred.breakdown
    table = Table(title="where the step and the memory go", title_justify="left")
    table.add_column("part")
    table.add_column("ms", justify="right")
    table.add_column("of step", justify="right")
    rows: list[tuple[Any, ...]] = []
    for key, what in _TIME_PARTS.items():
        seconds = b.get(key, 0.0)
        if seconds > 0:
            rows.append((what, f"{seconds * 1e3:.2f}", f"{seconds / pred.step_s:.0%}"))
    for row in rows:
        table.add_row(*row)
    table.add_section()
    for kind in _MEMORY_PARTS:
        nbytes = b.get("memory_" + kind, 0.0)
        if nbytes > 0:
            table.add_row(f"memory: {kind}", _gib(nbytes), "")
    table.add_row("memory: total, with allocator slack", _gib(pred.memory_per_rank), "")
    return table

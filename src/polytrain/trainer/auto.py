"""``strategy = "auto"``: the planner picks the layout and the process count, then it runs.

The launching process measures the model (`measure.stats`, meta device: no memory), reads this
host's saved profile (`polytrain calibrate`; without one the catalog's nominal figures are used),
asks the planner's search for the fastest layout on 1 to ``launch.nproc`` processes of this host
and writes the first plan's fields into the job (contract 3: a plan is exactly `JobConfig`
fields). The job that runs is the resolved one, ``strategy = "manual"``, so its saved
``job.toml`` records what the planner chose and replays it without planning again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from polytrain.config.base import to_dict
from polytrain.config.io import job_from_dict, merge
from polytrain.config.job import JobConfig
from polytrain.errors import PlanError
from polytrain.measure.host import profile_for
from polytrain.measure.stats import model_stats
from polytrain.planner.catalog import device_key_of
from polytrain.planner.cluster import parse_cluster
from polytrain.planner.cost import Env, predict
from polytrain.planner.search import PlanRequest, search
from polytrain.planner.types import HostProfile, Layout, Prediction

__all__ = [
    "AutoChoice",
    "JobEstimate",
    "apply_layout",
    "host_cluster_spec",
    "layout_of",
    "predict_job",
    "resolve_auto",
]


@dataclass(frozen=True)
class AutoChoice:
    job: JobConfig  # the resolved job (strategy = "manual")
    layout: Layout
    prediction: Prediction
    profiled: bool  # planned with a calibrated profile (else catalog figures)


def host_cluster_spec(job: JobConfig) -> str:
    """This host as a catalog cluster spec with ``launch.nproc`` devices."""
    if job.train.device == "cuda":  # resolved: [Note: device resolution]
        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
        key = device_key_of(name)
        if key is None:
            raise PlanError(
                f"strategy = 'auto': GPU {name!r} is not in the planner's catalog: plan it with "
                "`polytrain plan --cluster FILE.toml` and set the layout by hand"
            )
        return f"1x{job.launch.nproc}x{key}"
    return f"1x{job.launch.nproc}xcpu"


def resolve_auto(job: JobConfig, profile: HostProfile | None = None) -> AutoChoice:
    """The job with the planner's first plan applied (see the module docstring)."""
    if job.launch.nnodes > 1:
        raise PlanError(
            f"strategy = 'auto' plans one host, but launch.nnodes = {job.launch.nnodes}: plan "
            "the cluster with `polytrain plan --cluster ...` and pass its layout by hand"
        )
    cluster = parse_cluster(host_cluster_spec(job))
    profile = profile if profile is not None else profile_for(cluster.device.key)
    stats = model_stats(job)  # meta device: FLOPs and bytes, no weights
    request = PlanRequest(
        stats=stats,
        cluster=cluster,
        global_batch=job.train.global_batch_size,
        steps=job.train.steps,
        min_devices=1,
        max_devices=job.launch.num_procs,
        dtype=job.train.dtype,
        objective="time",
        profile=profile,
        bucket_bytes=job.parallel.bucket_mb * 2**20,
    )
    result = search(request)
    if result.best is None:
        raise PlanError(f"strategy = 'auto' found no layout that runs: {result.note}")
    prediction: Prediction = result.best.prediction
    resolved = apply_layout(job, prediction.layout)
    return AutoChoice(resolved, prediction.layout, prediction, profile is not None)


def apply_layout(job: JobConfig, layout: Layout) -> JobConfig:
    """``job`` with ``layout``'s fields (and ``strategy = "manual"``), validated anew."""
    data: dict[str, Any] = to_dict(job)
    data["strategy"] = "manual"
    for key, value in layout.overrides().items():
        merge(data, key.split("."), value)
    return job_from_dict(data)


def layout_of(job: JobConfig) -> Layout | None:
    """The planner's `Layout` of ``job`` (the inverse of `apply_layout`); None for what the
    planner does not price (hybrid and spatial parallelism, hierarchical parameter
    servers)."""
    p, pipe, ps = job.parallel, job.pipeline, job.ps
    policy = p.recompute_policy
    if p.hybrid or p.spatial > 1 or ps.hierarchical:
        return None
    pp = p.pp
    workers = job.world_size - (ps.servers if p.sync == "ps" else 0)
    dp = p.dp or max(1, workers // (p.tp * pp))
    return Layout(
        dp=dp,
        tp=p.tp,
        pp=pp,
        zero=p.zero,
        sync=p.sync,
        schedule=pipe.schedule,
        microbatches=pipe.microbatches if pp > 1 else 1,
        recompute=policy.mode != "none",
        recompute_every=policy.every,
        recompute_ops=policy.mode == "ops",
        grad_accum=job.train.grad_accum,
        ps_servers=ps.servers if p.sync == "ps" else 0,
        ps_mode=ps.mode,
        ps_leaves=ps.workers_per_leaf(ps.ranks_per_host or job.launch.num_procs)
        if p.sync == "ps"
        else 0,
        sufficient_factor=p.sufficient_factor == "on",
        partition=tuple(pipe.partition) if isinstance(pipe.partition, list) else (),
        topology=job.gossip.topology,
        period=job.localsgd.period,
    )


@dataclass(frozen=True)
class JobEstimate:
    """What `--dry-run` summarises: the model's size and the planner's figures for the job."""

    params: int
    layout: Layout | None  # None: a layout the planner does not price
    prediction: Prediction | None
    profiled: bool  # this host's calibrated profile (else catalog figures)


def predict_job(job: JobConfig) -> JobEstimate:
    """The planner's step time and memory per rank for ``job`` as written, on this host."""
    stats = model_stats(job)  # meta device: FLOPs and bytes, no weights
    layout = layout_of(job)
    if layout is None or job.launch.nnodes > 1:
        return JobEstimate(stats.params, layout, None, False)
    try:
        cluster = parse_cluster(host_cluster_spec(job))
    except (PlanError, RuntimeError, AssertionError):  # a GPU the catalog (or torch) cannot name
        return JobEstimate(stats.params, layout, None, False)
    profile = profile_for(cluster.device.key)
    env = Env(cluster, job.train.dtype, profile, job.parallel.bucket_mb * 2**20)
    try:
        prediction = predict(layout, stats, env, job.train.global_batch_size)
    except PlanError:  # a layout the cost model cannot price: the summary says so
        return JobEstimate(stats.params, layout, None, False)
    return JobEstimate(stats.params, layout, prediction, profile is not None)

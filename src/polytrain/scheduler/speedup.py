"""Speed-up curves for simulated jobs: a few model classes, each an Amdahl curve or the planner's.

Traces such as Philly's record how long a job ran on the devices it asked for, not how it
would scale on others; an elastic policy needs the whole curve. The simulators of Pollux
(OSDI'21) and Sia (SOSP'23) give each trace job a model class (chosen by its size) and use that
class's measured scaling. We do the same, with one of two sources.

**Analytic** (the default, :func:`curve`): class ``c`` has a serial fraction ``alpha`` and
speed-up ``s(k) = 1 / (alpha + (1 - alpha) / k)`` (Amdahl's law; equivalently
``k / (1 + alpha (k - 1))``: a fixed share of each step that does not shrink with more devices,
such as the gradient exchange of data parallelism). Classes by GPU-time (duration x devices),
on the assumption that longer jobs train larger models, which scale better (the curves are
ours, not fitted to any measurement)::

    class    alpha   s(8)   s(32)   GPU-time
    small    0.15    3.9     5.7    < 1 GPU-hour
    medium   0.05    5.9    12.5    < 10 GPU-hours
    large    0.02    7.0    19.8    < 100 GPU-hours
    xlarge   0.005   7.7    27.7    >= 100 GPU-hours

**Planner** (:func:`planned_curves`): each class is one GPT (``PLANNED_MODELS``, larger for
longer jobs), priced by polytrain's planner data-parallel on ``k`` devices of a catalog cluster
(default ``8x8xV100:ib100``, fp16, the precision the V100 catalog efficiency was measured in)
with the global batch fixed: ``s(k) = step(1) / step(k)``. Such a curve is not monotone: past
one host the gradient all-reduce crosses the slower link, and 9 devices can be slower than 8.
:func:`useful_counts` keeps the counts that beat every smaller one (no scheduler gives a job a
count slower than a smaller one) and the job's ask.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from polytrain.errors import ConfigError, PlanError
from polytrain.planner import Env, Layout, parse_cluster, predict
from polytrain.planner.stats_pure import gpt_stats

__all__ = [
    "MODEL_CLASSES",
    "PLANNED_MODELS",
    "PLAN_CLUSTER",
    "Curves",
    "curve",
    "model_class_for",
    "planned_curves",
    "useful_counts",
]

Curves = Mapping[str, Mapping[int, float]]  # model class -> device count -> speed-up

MODEL_CLASSES: dict[str, float] = {"small": 0.15, "medium": 0.05, "large": 0.02, "xlarge": 0.005}
_BOUNDS_GPU_S = ((3600.0, "small"), (36000.0, "medium"), (360000.0, "large"))


def model_class_for(duration_s: float, devices: int) -> str:
    """The class of a job that ran ``duration_s`` on ``devices`` (by its GPU-time)."""
    gpu_s = duration_s * devices
    for bound, name in _BOUNDS_GPU_S:
        if gpu_s < bound:
            return name
    return "xlarge"


def curve(model: str, max_devices: int, curves: Curves | None = None) -> dict[int, float]:
    """Speed-up at 1..max_devices devices relative to one device, for class ``model``: from
    ``curves`` (e.g. :func:`planned_curves`) where given, else the analytic class."""
    alpha = MODEL_CLASSES.get(model)
    if alpha is None:
        raise ConfigError(
            f"unknown model class {model!r}: choose one of {', '.join(MODEL_CLASSES)}"
        )
    if curves is None:
        return {k: 1.0 / (alpha + (1.0 - alpha) / k) for k in range(1, max_devices + 1)}
    given = curves[model]
    if max_devices not in given:
        raise ConfigError(
            f"the {model} speed-up curve stops at {max(given)} devices, {max_devices} needed: "
            "derive it for a cluster at least that large"
        )
    return {k: given[k] for k in range(1, max_devices + 1)}


def useful_counts(speedup: Mapping[int, float], keep: int) -> dict[int, float]:
    """The counts of ``speedup`` that are faster than every smaller count, and ``keep``."""
    out: dict[int, float] = {}
    best = 0.0
    for k in sorted(speedup):
        if speedup[k] > best or k == keep:
            out[k] = speedup[k]
        best = max(best, speedup[k])
    return out


@dataclass(frozen=True)
class PlannedModel:
    """The GPT (our ``models.gpt`` layout) the planner prices for one class, and its batch."""

    n_layer: int
    n_embd: int
    n_head: int
    block_size: int
    global_batch: int
    vocab_size: int = 50304


# Larger classes train larger models, as the analytic curves assume they scale better.
PLANNED_MODELS: dict[str, PlannedModel] = {
    "small": PlannedModel(6, 512, 8, 256, 32),
    "medium": PlannedModel(12, 768, 12, 1024, 32),  # GPT-2 small's shape
    "large": PlannedModel(24, 1024, 16, 1024, 64),  # GPT-2 medium's
    "xlarge": PlannedModel(36, 1280, 20, 1024, 128),  # GPT-2 large's
}
PLAN_CLUSTER = "8x8xV100:ib100"
_PLAN_DTYPE = "fp16"  # the V100 catalog efficiency is a mixed-precision measurement


def planned_curves(
    cluster: str = PLAN_CLUSTER, max_devices: int = 0
) -> dict[str, dict[int, float]]:
    """Each class's speed-up at 1..``max_devices`` (0: the cluster's size) data-parallel
    devices of ``cluster`` (a planner spec), from the planner's step times, the global batch
    fixed. Memory is not checked: a trace job ran on its ask, so it fit there."""
    try:
        plan = parse_cluster(cluster)
    except PlanError as exc:
        raise ConfigError(f"speed-up cluster {cluster!r}: {exc}") from None
    most = max_devices or plan.size
    if most > plan.size:
        raise ConfigError(
            f"speed-up cluster {cluster!r} has {plan.size} devices, {most} needed: give a larger "
            "one, e.g. 16x8xV100:ib100"
        )
    out: dict[str, dict[int, float]] = {}
    for name, m in PLANNED_MODELS.items():
        stats = gpt_stats(
            n_layer=m.n_layer,
            n_embd=m.n_embd,
            n_head=m.n_head,
            block_size=m.block_size,
            vocab_size=m.vocab_size,
            act_bytes=2,
        )
        step = {
            k: predict(
                Layout(dp=k), stats, Env(plan.with_size(k), dtype=_PLAN_DTYPE), m.global_batch
            ).step_s
            for k in range(1, most + 1)
        }
        out[name] = {k: step[1] / t for k, t in step.items()}
    return out

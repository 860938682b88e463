"""Analytic speed-up curves for simulated jobs: a few model classes, each an Amdahl curve.

Traces such as Philly's record how long a job ran on the devices it asked for, not how it
would scale on others; an elastic policy needs the whole curve. The simulators of Pollux
(OSDI'21) and Sia (SOSP'23) give each trace job a model class (chosen by its size) and use that
class's measured scaling. We do the same with analytic curves: class ``c`` has a serial fraction ``alpha`` and
speed-up ``s(k) = 1 / (alpha + (1 - alpha) / k)`` (Amdahl's law; equivalently
``k / (1 + alpha (k - 1))``: a fixed share of each step that does not shrink with more devices,
such as the gradient exchange of data parallelism). They are not derived from polytrain's
planner: pricing every device count of every job with the cost model needs a model and a
calibrated host per class, which a trace does not give.

Classes by GPU-time (duration x devices), on the assumption that longer jobs train larger
models, which scale better (the curves are ours, not fitted to any measurement)::

    class    alpha   s(8)   s(32)   GPU-time
    small    0.15    3.9     5.7    < 1 GPU-hour
    medium   0.05    5.9    12.5    < 10 GPU-hours
    large    0.02    7.0    19.8    < 100 GPU-hours
    xlarge   0.005   7.7    27.7    >= 100 GPU-hours
"""

from __future__ import annotations

from polytrain.errors import ConfigError

__all__ = ["MODEL_CLASSES", "curve", "model_class_for"]

MODEL_CLASSES: dict[str, float] = {"small": 0.15, "medium": 0.05, "large": 0.02, "xlarge": 0.005}
_BOUNDS_GPU_S = ((3600.0, "small"), (36000.0, "medium"), (360000.0, "large"))


def model_class_for(duration_s: float, devices: int) -> str:
    """The class of a job that ran ``duration_s`` on ``devices`` (by its GPU-time)."""
    gpu_s = duration_s * devices
    for bound, name in _BOUNDS_GPU_S:
        if gpu_s < bound:
            return name
    return "xlarge"


def curve(model: str, max_devices: int) -> dict[int, float]:
    """Speed-up at 1..max_devices devices relative to one device, for class ``model``."""
    alpha = MODEL_CLASSES.get(model)
    if alpha is None:
        raise ConfigError(
            f"unknown model class {model!r}: choose one of {', '.join(MODEL_CLASSES)}"
        )
    return {k: 1.0 / (alpha + (1.0 - alpha) / k) for k in range(1, max_devices + 1)}

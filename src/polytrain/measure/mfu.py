"""Model FLOPs utilisation's inputs as the planner counts them (torch-facing): achieved FLOP/s
over the device's dense peak (PaLM, Chowdhery et al. 2022, app. B).

The peak is the hardware catalog's (`catalog.dense_peak`) for the job's compute dtype; the
FLOPs per sample are the planner's own count of the job's model (`stats.train_flops_per_sample`),
so built-in and factory models are counted by the same rule, attention included. Where either
is unknown (a CPU, a GPU the catalog does not list, a forward that cannot run on the meta
device) MFU is not reported rather than guessed.
"""

from __future__ import annotations

import torch

from polytrain.config.job import JobConfig
from polytrain.data.datasets import Dataset, DataSpec
from polytrain.measure.stats import train_flops_per_sample
from polytrain.planner.catalog import dense_peak

__all__ = ["mfu_inputs", "peak_flops"]


def peak_flops(device: torch.device, dtype: str) -> float | None:
    """The catalog's dense peak FLOP/s of ``device`` for a job computing in ``dtype``
    (`train.dtype`): the bf16 peak for bf16 (autocast runs the matmuls there); for fp32 the
    fp32 peak, or the TF32 one when torch lets float32 matmuls use TF32
    (``torch.set_float32_matmul_precision("high")``; off by default), the rate they then run
    at. None on a CPU or a GPU the catalog does not list."""
    if device.type != "cuda":
        return None
    if dtype == "fp32" and torch.get_float32_matmul_precision() != "highest":
        dtype = "tf32"
    return dense_peak(torch.cuda.get_device_name(device), dtype)


def mfu_inputs(
    job: JobConfig, device: torch.device, spec: DataSpec, train_set: Dataset
) -> tuple[float, float | None]:
    """(forward + backward FLOPs per sample, peak FLOP/s of one ``device``) for ``job``; the
    peak is None when MFU cannot be stated. The FLOPs are counted (on the meta device) only
    where a peak is known."""
    peak = peak_flops(device, job.train.dtype)
    flops = train_flops_per_sample(job, spec, train_set) if peak else None
    if flops is None:
        return 0.0, None
    return flops, peak

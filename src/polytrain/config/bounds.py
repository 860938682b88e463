"""Numbers that pass a section's range check but cannot work: infinities and absurd sizes.

Each section checks its own ranges (``lr > 0``, ``0 <= momentum < 1``), but ``inf > 0`` holds,
and ``1e300``, a batch of 1e11 samples or a seed of 2^70 are "positive" too: they used to pass
pre-flight and crash inside every worker (an overflowing timedelta, ``manual_seed`` overflow, a
storage-size overflow). `check_bounds` runs on every `JobConfig` (from TOML, flags or Python):
every float field must be finite, and the fields below must stay under a bound past which the
value cannot work on any machine polytrain targets. The bounds are generous on purpose: they
catch typos and overflows, not unusual choices.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from polytrain.errors import ConfigError

__all__ = ["UPPER_BOUNDS", "check_bounds"]

# "section.key" -> (largest accepted value, why larger cannot work / what to do).
UPPER_BOUNDS: dict[str, tuple[float, str]] = {
    "optim.lr": (1e3, "learning rates are usually 1e-5 to 1"),
    "optim.weight_decay": (1e3, "weight decay is usually 0 to 0.1"),
    "optim.grad_clip": (1e12, "use 0 to turn clipping off"),
    # gloo and NCCL take timeouts in int32 milliseconds in places; 1e6 s is 11.6 days.
    "launch.timeout_s": (1e6, "a collective timeout is seconds to minutes"),
    "ps.worker_timeout_s": (1e6, "a worker timeout is seconds to minutes"),
    "ps.join_delay_s": (1e6, "a join delay is seconds"),
    "ps.straggler_delay_s": (1e6, "a straggler delay is seconds"),
    "gossip.straggler_delay_s": (1e6, "a straggler delay is seconds"),
    "parallel.bucket_mb": (1e6, "DDP buckets are usually 1 to 100 MiB"),
    "pipeline.memory_limit_mb": (1e9, "use 0 for no limit"),
    # Sampler: torch.Generator.manual_seed(seed * 1_000_003 + step) must fit in 64 bits.
    "train.seed": (2**43 - 1, "use a seed below 2^43"),
    "train.steps": (2**40, "a run of more steps would never finish"),
    "train.global_batch_size": (2**24, "one step would not fit in memory; lower --batch-size"),
    "train.grad_accum": (2**20, "lower train.grad_accum"),
    "train.eval_batches": (2**20, "lower train.eval_batches"),
    "train.sample_tokens": (2**20, "lower train.sample_tokens"),
    "model.n_layer": (2**12, "lower model.n_layer"),
    "model.n_embd": (2**16, "the widest published models use about 2^14; lower model.n_embd"),
    "model.n_head": (2**12, "lower model.n_head"),
    "model.block_size": (2**20, "lower model.block_size"),
    "pipeline.microbatches": (2**16, "lower pipeline.microbatches"),
    "ps.chunk_kb": (2**20, "chunks are usually 64 KiB to 16 MiB"),
    "launch.nproc": (2**12, "lower --nproc"),
    "launch.nnodes": (2**16, "lower --nnodes"),
}


def check_bounds(job: Any) -> None:
    """`ConfigError` for the first non-finite float or value above its bound in ``job``."""
    for section in dataclasses.fields(job):
        cfg = getattr(job, section.name)
        if not dataclasses.is_dataclass(cfg):
            continue
        for f in dataclasses.fields(cfg):
            key = f"{section.name}.{f.name}"
            value = getattr(cfg, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{key} = {value!r}: expected a finite number")
            bound = UPPER_BOUNDS.get(key)
            if bound is None or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            limit, hint = bound
            if value > limit:
                shown = f"{limit:g}" if isinstance(limit, float) else f"{limit}"
                raise ConfigError(f"{key} = {value!r} is above the largest usable {shown}: {hint}")

"""What a fresh training worker holds before its model's own states ([Note: a worker's own
memory] in planner/memory.py): the imports, the runtime its first optimizer and step add
(`fresh_worker_memory`, for `polytrain calibrate`) and what a user's model factory adds
(`factory_import_bytes`, for `measure.stats`). Each is read in a fresh interpreter: a worker is
one (the launcher spawns ``python -m polytrain.trainer.worker``), and this process has imported
other things.
"""

from __future__ import annotations

import os
import subprocess
import sys

from polytrain.errors import PlanError

__all__ = ["WORKER_IMPORTS", "factory_import_bytes", "fresh_worker_memory"]


WORKER_IMPORTS = (
    "import torch, polytrain.trainer.worker, polytrain.parallel, polytrain.pipeline, "
    "polytrain.ps, polytrain.gossip.strategy, polytrain.gossip.localsgd; "
    "from polytrain.observe.metrics import peak_memory_mb; "
    "print(peak_memory_mb(torch.device('cpu')))"
)


# [Note: a worker's own memory] in planner/memory.py: after the imports (their peak printed by
# WORKER_IMPORTS), one optimizer (whose first construction imports torch._dynamo) and two steps
# of a miniature of the default model (gpt: embedding, layer norm, attention, GELU,
# cross-entropy), then the peak again and the seconds spent after the imports
_MINI_STEP = (
    "; from polytrain.config.job import ModelConfig, OptimConfig"
    "; from polytrain.core.optim import build_optimizer"
    "; from polytrain.data.datasets import DataSpec"
    "; from polytrain.models.registry import build_model"
    "; torch.set_num_threads(1)"
    "; spec = DataSpec(kind='tokens', vocab_size=16, input_shape=(8,))"
    "; model = build_model(ModelConfig(n_layer=1, n_embd=16, n_head=2, block_size=8), spec, 0)"
    "; opt = build_optimizer(model.parameters(), OptimConfig())"
    "; x = torch.zeros(2, 8, dtype=torch.long)"
    "\nfor _ in range(2): model.loss(model(x), x).backward(); opt.step(); opt.zero_grad()"
)
_WORKER_STEP = (
    WORKER_IMPORTS
    + "; import time; t0 = time.perf_counter()"
    + _MINI_STEP
    + "\nprint(peak_memory_mb(torch.device('cpu')))"
    "\nprint(time.perf_counter() - t0)"
)


def fresh_worker_memory() -> tuple[float, float, float]:
    """(baseline bytes, runtime bytes, seconds past the imports) of one fresh interpreter.

    Baseline: the peak resident bytes once it imported what a training worker imports
    (`polytrain.trainer.worker` and the strategy packages). Workers are fresh processes
    (``python -m polytrain.trainer.worker``, spawned by the launcher), so their baseline holds
    every page of torch and polytrain; a harness rank forked from a warm parent reports less
    (the parent's pages it never touches are not its own). Runtime: what it then adds by
    building an optimizer and running a step of a negligible model ([Note: a worker's own
    memory] in planner/memory.py), which every worker holds whatever its model. The seconds
    after the imports let the caller keep that work out of a start-up time."""
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER_STEP], capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        raise PlanError(f"measuring a worker's memory failed: {proc.stderr.strip()[-300:]}")
    before, after, seconds = (float(v) for v in proc.stdout.strip().splitlines()[-3:])
    return before * 2**20, max(after - before, 0.0) * 2**20, seconds


# What a worker that trains a user's model adds: the factory's module (and what it imports:
# transformers, timm...) and the model built from it, on the meta device (no weights: those are
# the model states, priced apart). The peak after the worker's own imports and the runtime's
# miniature step (which imports much of torch that a factory's imports and the meta build
# would import too: torch._dynamo, FSDP, DTensor; counted once, in the runtime), then after these.
_FACTORY = (
    WORKER_IMPORTS + _MINI_STEP + "; import sys"
    "; from polytrain.config.io import job_from_dict, load_job"
    "; from polytrain.data.datasets import build_datasets"
    "; from polytrain.models.registry import block_size_of, build_model"
    "; job = job_from_dict(load_job(sys.argv[1]))"
    "; _, _, spec = build_datasets(job.data, block_size_of(job.model))"
    "; print(peak_memory_mb(torch.device('cpu')))"
    "\nwith torch.device('meta'): build_model(job.model, spec, job.train.seed)"
    "\nprint(peak_memory_mb(torch.device('cpu')))"
)


def factory_import_bytes(job_file: str) -> float:
    """Resident bytes that importing the job's model factory and building its model (on meta)
    add to a fresh worker, read in one from the job saved at ``job_file`` (run in the current
    directory, where the CLI finds a ``my_models.py``). The data set is loaded before the first
    reading: its bytes are `ModelStats.data_bytes`."""
    proc = subprocess.run(
        [sys.executable, "-c", _FACTORY, job_file],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.getcwd(),
    )
    if proc.returncode != 0:
        raise PlanError(
            f"measuring the model factory's memory failed: {proc.stderr.strip()[-300:]}"
        )
    before, after = (float(v) for v in proc.stdout.strip().splitlines()[-2:])
    return max(after - before, 0.0) * 2**20

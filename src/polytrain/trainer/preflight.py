"""Checks run in the launching process, before any worker starts (cheap, no collectives).

Everything a user can get wrong about a job and that can be known without running it is caught
here, so a mistake costs a one-line error instead of N crashed workers.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys

import torch

from polytrain.comm.init import resolve_backend
from polytrain.config import devices
from polytrain.config.job import JobConfig
from polytrain.data.datasets import build_datasets
from polytrain.errors import ConfigError, MeshError
from polytrain.models.base import BlockModel
from polytrain.models.blocks import disable_inplace
from polytrain.models.checks import check_model, check_objective, check_vocabulary
from polytrain.models.pretrained import check_pretrained
from polytrain.models.registry import block_size_of, build_model
from polytrain.observe.trackers import check_trackers
from polytrain.trainer.build import strategy_family
from polytrain.trainer.outputs import check_output_paths
from polytrain.trainer.ownership import check_checkpoint_dir

__all__ = ["check_compile", "check_devices", "preflight"]


def preflight(job: JobConfig) -> BlockModel:
    """Validate data, model and layout together; return the model built on the meta device.

    The checks common to every strategy are here; each strategy family's own come from the
    family table (`trainer.build.strategy_family`).
    """
    check_output_paths(job)  # [Note: output paths]
    check_devices(job)
    check_compile(job)
    check_trackers(job.observe.trackers)  # [Note: optional tracker packages]
    family = strategy_family(job)
    train_data, _, spec = build_datasets(job.data, block_size_of(job.model))
    try:
        with torch.device("meta"):
            model = build_model(job.model, spec, job.train.seed)
    except RuntimeError as exc:  # e.g. "Storage size calculation overflowed"
        raise ConfigError(
            f"model {job.model.name!r} cannot be built with these dimensions "
            f"({str(exc).splitlines()[0][:100]}): lower model.n_embd / n_layer / block_size"
        ) from None
    if job.parallel.pp > 1 or job.parallel.tp > 1:  # as the workers do (strategy families)
        disable_inplace(model)
    check_model(job, model, train_data.get(torch.arange(min(2, len(train_data)))))
    if spec.kind == "tokens":
        check_vocabulary(job, model, spec.vocab_size)
        check_objective(job, model)
    if job.model.init_from:  # names and shapes from the files' headers, nothing loaded
        check_pretrained(model, job.model.init_from)
    if job.launch.nnodes > 1 and job.launch.num_procs % job.parallel.tp:
        raise MeshError(  # consecutive ranks share a host; tp groups are consecutive ranks
            f"parallel.tp = {job.parallel.tp} does not divide --nproc {job.launch.nproc}: "
            "tensor-parallel groups would straddle hosts; choose a tp that divides the "
            "processes per node"
        )
    family.checks(job, model, train_data)
    check_checkpoint_dir(job)  # [Note: checkpoint ownership]
    return model


def check_devices(job: JobConfig) -> None:
    """A CUDA job over NCCL needs a GPU per rank on this node: NCCL refuses two ranks on one
    device, and ranks take devices by local rank (`comm.init`). Over gloo, ranks may share a
    GPU (each copies through the host), which runs every strategy's CUDA path on one GPU.
    (CUDA itself is checked where the job resolves its devices: [Note: device resolution].)"""
    gpus = devices.visible_gpus()
    nproc = job.launch.num_procs
    backend = resolve_backend(job.launch.backend, job.train.device)
    if job.train.device == "cuda" and nproc > gpus and backend == "nccl":
        raise ConfigError(
            f"launch.nproc = {nproc} ranks with train.device = 'cuda' (nccl) on a node with "
            f"{gpus} GPU(s): each rank needs its own GPU under nccl; use --nproc {gpus} (or "
            "--nproc gpu), --set launch.backend='gloo' to share GPUs, or --device cpu for more processes"
        )


def check_compile(job: JobConfig, *, cuda: bool | None = None) -> None:
    """Refuse ``train.compile`` in one line where Inductor cannot build kernels on this host
    (checked before any worker starts; otherwise every rank fails in its first step).

    Every strategy family compiles (`core.compile`, docs/compile.md); what can be missing
    is the toolchain: on the CPU Inductor compiles C++ with ``$CXX`` (default g++; clang++ on
    macOS), on a GPU it writes Triton kernels. ``cuda`` (whether the job gets GPUs) is for
    tests.
    """
    if not job.train.compile:
        return
    if cuda is None:
        cuda = job.train.device == "cuda" or (
            job.train.device == "auto" and torch.cuda.is_available()
        )
    if cuda:
        if importlib.util.find_spec("triton") is None:
            raise ConfigError(
                f"train.compile = true on train.device = {job.train.device!r} needs Triton "
                "(Inductor's GPU kernels) and it is not installed: pip install triton, or "
                "drop --compile"
            )
        return
    cxx = os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")
    if shutil.which(cxx) is None:
        raise ConfigError(
            f"train.compile = true on the CPU needs a C++ compiler for Inductor's kernels and "
            f"{cxx!r} (from $CXX, else the default) is not on PATH: install one (e.g. "
            "apt-get install g++) or set CXX to it, or drop --compile"
        )

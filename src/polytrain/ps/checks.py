"""Pre-launch checks of a parameter-server job (run by trainer.preflight; no processes)."""

from __future__ import annotations

from torch import nn

from polytrain.config.job import JobConfig
from polytrain.errors import ConfigError
from polytrain.ps.sharding import plan_shards

__all__ = ["check_ps_job", "checkpoint_refusal"]


def checkpoint_refusal(job: JobConfig) -> str:
    """Why this parameter-server job cannot be checkpointed ('' when it can).

    The one home of the rule: pre-flight raises it as a `ConfigError`, and `PSStrategy`
    declares it (``checkpointable``, ``checkpoint_refusal``) for the checkpointer.
    """
    if job.ps.mode == "sync":  # colocated or not ([Note: colocated checkpoints] in ps.local)
        return ""
    return (
        f"checkpoint.dir = {job.checkpoint.dir!r} with ps.mode = {job.ps.mode!r}: only "
        f"ps.mode = 'sync' parameter-server jobs can be checkpointed (async/ssp workers run "
        f"ahead of the servers and must not meet in world collectives); use ps.mode = "
        f"'sync', or drop --checkpoint-dir and export final weights with --save-final"
    )


def check_ps_job(job: JobConfig, model: nn.Module) -> None:
    """Raise `ConfigError` for what `parallel.sync = 'ps'` cannot run (model on any device)."""
    p = job.parallel
    if p.tp > 1 or p.pp > 1:
        raise ConfigError(
            f"parallel.sync = 'ps' with tp = {p.tp}, pp = {p.pp}: parameter-server workers each "
            f"hold a whole model replica; set tp = 1 and pp = 1"
        )
    if job.train.device == "cuda":
        raise ConfigError(
            "train.device = 'cuda' with parallel.sync = 'ps': the parameter server runs on CPU "
            "over gloo; set --device cpu, or use parallel.sync = 'allreduce' on GPUs"
        )
    if p.grad_compression != "none":
        raise ConfigError(
            f"parallel.grad_compression = {p.grad_compression!r} with parallel.sync = 'ps': "
            "workers push full-precision gradients to the servers; use grad_compression = "
            "'none', or sync = 'allreduce' for compressed all-reduce"
        )
    refusal = checkpoint_refusal(job)
    if job.checkpoint.dir and refusal:
        raise ConfigError(refusal)
    params = [(n, t.numel() * t.element_size()) for n, t in model.named_parameters()]
    plan_shards(params, job.ps.servers)  # more servers than parameters is a ConfigError

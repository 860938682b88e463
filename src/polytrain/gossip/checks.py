"""Pre-launch checks of a decentralized job that need the strategy's knowledge (no processes).

Ranges and world-size rules live in `polytrain.config.decentralized`; what is here is the one
home of the checkpoint rule, raised by pre-flight as a `ConfigError` and declared by the
strategies (``checkpointable``, ``checkpoint_refusal``) for the checkpointer.
"""

from __future__ import annotations

from polytrain.config.job import JobConfig

__all__ = ["checkpoint_refusal"]


def checkpoint_refusal(job: JobConfig) -> str:
    """Why this decentralized job cannot be checkpointed ('' when it can)."""
    if job.parallel.sync == "gossip" and job.gossip.mode == "async":
        return (
            f"checkpoint.dir = {job.checkpoint.dir!r} with gossip.mode = 'async': asynchronous "
            "replicas never meet, so there is no consistent state to save; use gossip.mode = "
            "'sync', or drop --checkpoint-dir and export final weights with --save-final"
        )
    return ""

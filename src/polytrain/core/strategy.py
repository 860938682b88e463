"""The interface between the training loop and a parallel strategy, with its capabilities declared.

A strategy owns its model parts and optimizer. The loop only asks it to run step ``t`` (it
fetches its own slice of the global batch, contract 1), to evaluate, and to hand back the full
weights. What a strategy can and cannot do (be checkpointed, resume at a step, meet the world
in collectives, evaluate) is declared here as class attributes with defaults, so the loop and
the checkpointer read them instead of probing with ``getattr``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from polytrain.errors import PolytrainError
from polytrain.observe.trace import Tracer

__all__ = ["NonFiniteLossError", "StepOutput", "Strategy", "step_result"]


class NonFiniteLossError(PolytrainError):
    """The loss or a gradient became NaN or Inf and ``train.on_nonfinite = 'stop'``."""


@dataclass(frozen=True)
class StepOutput:
    """What one training step reports.

    [Note: deferred step results] A step's result may be read later than the step: ``loss =
    nan`` and ``complete``, a function that returns the final output (reading it on the host,
    waiting for a reduction started without blocking, raising `NonFiniteLossError` under
    ``stop``). Two kinds of strategy return one. A step ended on the device ([Note: the step
    stays on the device] in `polytrain.core.step`) sets ``flag`` too, a 0-d device tensor that
    is non-zero where the step was non-finite: the loop reads such results only when it logs,
    evaluates, checkpoints or ends, and under ``stop`` copies each flag to the host without
    blocking and stops as soon as a copy shows one set, naming its step. A strategy whose ranks
    run out of step with each other (PipeDream's stream has no flush) would lose its overlap to
    a world collective that ends every step; it returns ``complete`` alone, and the loop calls it
    after it has started the next step (or at once before an evaluation, a checkpoint or the
    last step), so a non-finite stop is raised one step later, naming the step it belongs to.
    Code that calls ``train_step`` directly reads a result with `step_result`.
    """

    loss: float  # mean loss over the global batch (the same value on every rank)
    skipped: bool = False
    metrics: dict[str, float] = field(default_factory=dict)  # extra fields for the record
    complete: Callable[[], StepOutput] | None = None
    flag: torch.Tensor | None = None  # non-zero on the device where the step was non-finite


def step_result(out: StepOutput) -> StepOutput:
    """``out`` with its deferred part waited for ([Note: deferred step results])."""
    return out.complete() if out.complete is not None else out


class Strategy(ABC):
    """What the loop needs from a parallel strategy, and what the strategy declares it can do.

    Set by every strategy: ``name``; ``modules``, this rank's model parts whose ``state_dict``
    keys are the unwrapped model's (``blocks.<i>...``); ``optimizer``, which updates exactly
    their parameters (None where this rank updates nothing); ``tracer``, this rank's spans for
    ``--trace`` (disabled when not asked for). Checkpoints use ``modules`` and ``optimizer``
    unless `checkpoint_parts` says otherwise.

    Declared capabilities (class or instance attributes; the defaults suit an SPMD strategy):

    - ``checkpointable``: the checkpointer may save and restore this strategy. When False,
      ``checkpoint_refusal`` is the one-line reason and fix the checkpointer raises.
    - ``checkpoint_group``: the process group for the checkpointer's collectives (None: the
      default group). A strategy whose default group carries point-to-point traffic on other
      threads (parameter servers) gives a world group of its own.
    - ``world_collectives``: whether every rank may meet in world collectives after start-up.
      False for strategies that survive dead ranks (parameter servers in async/ssp); the loop
      then skips its final world barrier.
    - ``evaluates``: whether `evaluate` returns this rank's validation loss (False: it returns
      NaN because the rank holds no model replica, e.g. a parameter server; it must still be
      called on every rank).
    - `resume_at`: called by the checkpointer after a restore (default: nothing to do).
    - `before_save`: called by the checkpointer before it reads this rank's state for a save
      (default: nothing to do; a rank whose optimizer runs on another thread waits for it).
    - `checkpoint_parts`: the modules and optimizer the checkpointer saves and loads (default:
      ``modules`` and ``optimizer``).
    """

    name: str
    modules: list[nn.Module]
    optimizer: torch.optim.Optimizer | None
    tracer: Tracer

    checkpointable: bool = True
    checkpoint_refusal: str = ""
    checkpoint_group: Any = None
    world_collectives: bool = True
    evaluates: bool = True

    @abstractmethod
    def train_step(self, step: int) -> StepOutput:
        """Run 0-based step ``step`` on this rank's slice of the global batch."""

    @abstractmethod
    def evaluate(self, num_batches: int) -> float:
        """Validation loss over ``num_batches`` batches (called on every rank)."""

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every rank calls it; rank 0 gets the unwrapped model's full weights."""

    def evaluation_metrics(self) -> dict[str, float]:
        """Further metrics of the last `evaluate`, merged into its record (e.g. SPMD's
        ``val_accuracy`` on classification data); empty where a strategy computes none."""
        return {}

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of this rank's optimizer for the next step."""
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr

    def resume_at(self, step: int) -> None:  # noqa: B027  # an optional hook, empty by default
        """Called by the checkpointer after a restore: the next step to run is ``step``."""

    def before_save(self, step: int) -> None:  # noqa: B027  # an optional hook, empty by default
        """Called by the checkpointer before it reads this rank's state for the save after
        ``step`` steps: the state must then be that after ``step`` updates."""

    def checkpoint_parts(self) -> tuple[list[nn.Module], torch.optim.Optimizer | None]:
        """The model parts (keyed like ``modules``) and the optimizer the checkpointer saves and
        loads: ``modules`` and ``optimizer`` unless a strategy holds state the loop must not
        see as its own (a colocated parameter server's shard, updated on a thread)."""
        return self.modules, self.optimizer

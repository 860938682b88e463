"""The low-level core every strategy builds on; imports no strategy package and no trainer.

`Strategy` (the loop's interface, capabilities declared), `StepOutput`, `finish_step` and the
per-step rules ([Note: one step contract] in `polytrain.core.step`), the optimizer and LR
schedule, and the strategy-family registry the trainer selects from. Beside them, the
components that more than one family uses (families never import each other): `batchnorm`,
`recompute`, `compile`, `microbatch` (the forward/backward loop) and `cadence` (when a
checkpoint is due).
"""

from polytrain.core.modules import module_of
from polytrain.core.optim import build_optimizer, lr_at
from polytrain.core.step import (
    StepRules,
    apply_update,
    autocast,
    clip_coefficient,
    clip_gradients_,
    finish_step,
    mean_over,
    nonfinite_flag,
    nonfinite_outcome,
    sum_over,
)
from polytrain.core.strategy import NonFiniteLossError, StepOutput, Strategy, step_result

__all__ = [
    "NonFiniteLossError",
    "StepOutput",
    "StepRules",
    "Strategy",
    "apply_update",
    "autocast",
    "build_optimizer",
    "clip_coefficient",
    "clip_gradients_",
    "finish_step",
    "lr_at",
    "mean_over",
    "module_of",
    "nonfinite_flag",
    "nonfinite_outcome",
    "step_result",
    "sum_over",
]

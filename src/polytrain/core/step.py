"""One step contract: how every strategy ends its training step.

[Note: one step contract] After its forward and backward, every strategy ends the step the
same way, through `finish_step`:

1. this rank's loss share and a NaN/Inf-gradient flag (`nonfinite_flag`, or on the device
   path the clip's global norm being non-finite) are stacked and
   reduced in one collective over the strategy's groups (`mean_over` for SPMD and synchronous
   parameter-server workers, `sum_over` for pipelines whose loss lives on the last stage), so
   every rank holds the same loss and flag and takes the same branch;
2. a non-finite loss or gradient follows ``train.on_nonfinite`` (`nonfinite_outcome`): ``stop``
   raises `NonFiniteLossError` naming the 1-based step, ``skip`` drops the update and reports
   the step as skipped;
3. gradients are clipped to ``optim.grad_clip`` by their global norm (`clip_gradients_`; the
   strategy says how its norm is summed over its groups, the coefficient is applied here);
4. the update: the optimizer step, or a strategy's own (a parameter-server worker's push).

[Note: the step stays on the device] Reading the loss or the flag on the host makes the host
wait for the device at every step, so on a GPU it cannot queue the next step while this one
runs. Where the update is an optimizer that takes a ``found_inf`` flag (torch's fused AdamW
and SGD, the default: `core.optim.build_optimizer`), steps 2-4 happen on the device: the
update is applied as a no-op when the reduced flag says non-finite (in ``stop`` and ``skip``
alike, so no non-finite update is ever applied), and the step returns a deferred result
(`StepOutput.complete`, [Note: deferred step results]) that reads [loss, flag] when the loop
logs, with ``flag`` for the loop's early, non-blocking check under ``stop``. Other updates (a
custom ``update``, an optimizer without ``found_inf``) read the flag on the host first, as
before. Norms and flags are multi-tensor reductions (one kernel per device and dtype).

Strategies whose update cannot wait for the end of the step (PipeDream updates inside its
stream) use the pieces, `apply_update` and `nonfinite_outcome`, as far as their semantics allow.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch

from polytrain._lazy_dist import local_tensor
from polytrain._torch_private import scale_, step_skipped_if, supports_found_inf
from polytrain.comm.collectives import all_reduce_mean, all_reduce_sum_
from polytrain.config.job import JobConfig
from polytrain.core.loss_scale import LossScale
from polytrain.core.strategy import NonFiniteLossError, StepOutput
from polytrain.observe.trace import Tracer

__all__ = [
    "AUTOCAST_DTYPES",
    "GradNorm",
    "Reduce",
    "StepRules",
    "all_finite",
    "apply_update",
    "autocast",
    "clip_coefficient",
    "clip_gradients_",
    "finish_step",
    "mean_over",
    "nonfinite_flag",
    "nonfinite_outcome",
    "sum_over",
]

# Reduces this rank's stacked [loss share, non-finite flag] in place over the strategy's groups
# and returns it, still on the device: [the job's loss, > 0 where any rank saw a non-finite
# gradient].
Reduce = Callable[[torch.Tensor], torch.Tensor]
# The global norm of this rank's gradients, summed over the strategy's groups.
GradNorm = Callable[[Sequence[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class StepRules:
    """The per-step rules of a job: what to do with NaN/Inf, and the clipping threshold."""

    on_nonfinite: Literal["stop", "skip"]
    grad_clip: float  # 0 = off

    @classmethod
    def of(cls, job: JobConfig) -> StepRules:
        return cls(on_nonfinite=job.train.on_nonfinite, grad_clip=job.optim.grad_clip)


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager[Any]:
    """``train.dtype``'s autocast region (bf16, fp16) or nothing (fp32)."""
    if dtype in AUTOCAST_DTYPES:
        return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[dtype])
    return contextlib.nullcontext()


@torch.no_grad()
def nonfinite_flag(params: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """1.0 if any local gradient (a DTensor's local shard) holds NaN or Inf, else 0.0 (0-d, on
    ``device``, not read on the host).

    A NaN can enter the gradient while the loss stays finite (an overflowing backward, a bad
    custom autograd function), so the loss check alone misses it. The 2-norm over all local
    gradients (one multi-tensor reduction per device and dtype, the fastest of torch's norms)
    is NaN or Inf when some element is. It also reads Inf when finite gradients are so large
    that their squares overflow (beyond about 1e19 in float32); no useful update comes of those
    either (clipping would scale them to zero), and the step is treated as non-finite.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), device=device)
    return _nonfinite(_local_norm(grads), device)


def _nonfinite(norm: torch.Tensor, device: torch.device) -> torch.Tensor:
    """1.0 on ``device`` where the gradient norm ``norm`` is NaN or Inf, else 0.0."""
    return (~torch.isfinite(norm)).float().to(device)


def mean_over(*groups: Any) -> Reduce:
    """Average over each group in turn (data-parallel replicas, then tensor-parallel peers).

    No groups: this rank's own values (a worker that meets nobody, e.g. async parameter server).
    """

    def reduce(stats: torch.Tensor) -> torch.Tensor:
        for group in groups:
            all_reduce_mean(stats, group)
        return stats

    return reduce


def sum_over(group: Any, divisor: float) -> Reduce:
    """Sum over ``group`` (None: the world), then divide the loss by ``divisor``.

    For pipelines: only the last stage holds a loss share, so the world's sum counted once per
    replica (and per tensor-parallel rank of the last stage) is divided by their number.
    """

    def reduce(stats: torch.Tensor) -> torch.Tensor:
        all_reduce_sum_(stats, group)
        stats[0] /= divisor
        return stats

    return reduce


def clip_coefficient(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """The factor that scales gradients of norm ``total_norm`` to at most ``max_norm``.

    torch's ``clip_grad_norm_`` formula, so every strategy clips exactly as the single-process
    run does.
    """
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


def _local_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.get_total_norm([local_tensor(g) for g in grads])


@torch.no_grad()
def clip_gradients_(
    params: Iterable[torch.Tensor],
    max_norm: float,
    grad_norm: GradNorm | None = None,
    *,
    total: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scale the gradients of ``params`` so their global norm is at most ``max_norm``.

    ``grad_norm`` sums the norm over the strategy's groups (default: this rank's gradients
    only, for a strategy whose rank holds every parameter or clips per stage); ``total`` is
    that norm when the caller has it already. Returns the norm (on the device: nothing is read
    on the host).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if total is None:
        total = (grad_norm or _local_norm)(grads)
    scale_([local_tensor(g) for g in grads], clip_coefficient(max_norm, total))
    return total


def nonfinite_outcome(
    step: int, value: float, bad_grad: bool, rules: StepRules, *, hint: str = ""
) -> StepOutput:
    """The step's result when its loss or a gradient is NaN/Inf (every rank agrees on it).

    ``stop`` raises `NonFiniteLossError` naming the 1-based step; ``skip`` reports the step as
    skipped (the caller has dropped the update).
    """
    if rules.on_nonfinite == "skip":
        return StepOutput(loss=value, skipped=True)
    what = f"loss is {value}"
    if bad_grad and math.isfinite(value):
        what = f"a gradient is NaN/Inf (loss {value:.4g})"
    raise NonFiniteLossError(
        f"{what} at step {step + 1}: lower optim.lr, enable optim.grad_clip, or set "
        f"train.on_nonfinite = 'skip'{hint}"
    )


def apply_update(
    params: Sequence[torch.Tensor],
    rules: StepRules,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    grad_norm: GradNorm | None = None,
    update: Callable[[], None] | None = None,
) -> torch.Tensor | None:
    """Clip (when ``optim.grad_clip > 0``), then the update: ``update`` or the optimizer step.
    Returns the clip's global norm (on the device), None without clipping."""
    norm = clip_gradients_(params, rules.grad_clip, grad_norm) if rules.grad_clip > 0 else None
    if update is not None:
        update()
    elif optimizer is not None:
        optimizer.step()
    return norm


def finish_step(
    step: int,
    loss: torch.Tensor,
    params: Iterable[torch.Tensor],
    rules: StepRules,
    *,
    reduce: Reduce,
    optimizer: torch.optim.Optimizer | None = None,
    grad_norm: GradNorm | None = None,
    update: Callable[[], None] | None = None,
    drop: Callable[[], None] | None = None,
    tracer: Tracer | None = None,
    hint: str = "",
    loss_scale: LossScale | None = None,
) -> StepOutput:
    """End step ``step`` ([Note: one step contract]): reduce, check, clip, update.

    ``loss`` is this rank's share of the job's loss (0-d), ``params`` this rank's parameters
    with their gradients. ``update`` replaces the optimizer step (a parameter-server push);
    ``drop`` replaces discarding the gradients when the step is non-finite (default: the
    optimizer's ``zero_grad``). ``hint`` is appended to the non-finite stop's message.
    ``loss_scale``: fp16's, whose factor scaled the backward ([Note: dynamic loss scaling]).
    """
    params = list(params)
    if loss_scale is not None:
        loss_scale.unscale_([local_tensor(p.grad) for p in params if p.grad is not None])
    on_device = update is None and optimizer is not None and supports_found_inf(optimizer)
    norm = None
    if on_device and rules.grad_clip > 0:
        # The clip's global norm is non-finite exactly when `nonfinite_flag` would be set on
        # some rank: one pass over the gradients serves both.
        grads = [p.grad for p in params if p.grad is not None]
        norm = (grad_norm or _local_norm)(grads) if grads else torch.zeros(())
        flag = _nonfinite(norm, loss.device)
    else:
        flag = nonfinite_flag(params, loss.device)
    stats = reduce(torch.stack([loss.detach().float(), flag]))
    span = tracer.span("optimizer", cat="optim", step=step) if tracer else contextlib.nullcontext()
    scaled = loss_scale is not None
    if on_device:
        assert optimizer is not None
        # [Note: the step stays on the device]
        loss_bad = ~torch.isfinite(stats[0])
        bad = (loss_bad | (stats[1] > 0)).float()
        with span:
            if norm is not None:
                clip_gradients_(params, rules.grad_clip, total=norm)
            step_skipped_if(optimizer, bad)
        if loss_scale is not None:
            loss_scale.update(bad)
        # An fp16 overflow skips the step; only a non-finite loss is watched for a stop.
        watched = loss_bad.float() if scaled else bad
        if norm is not None:  # read with the loss, in the same copy ([Note: grad_norm])
            stats = torch.cat([stats, norm.detach().float().reshape(1).to(stats.device)])
        return StepOutput(
            loss=math.nan,
            complete=partial(_read_result, step, stats, rules, hint, scaled),
            flag=watched,
        )
    value, flag = stats.tolist()
    if not math.isfinite(value) or flag > 0:
        # Every rank holds the same reduced loss and flag, so every rank takes this branch.
        if drop is not None:
            drop()
        elif optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        if loss_scale is not None:
            loss_scale.update(torch.ones(()))
        return _outcome(step, value, flag > 0, rules, hint, scaled)
    with span:
        norm = apply_update(params, rules, optimizer=optimizer, grad_norm=grad_norm, update=update)
    if loss_scale is not None:
        loss_scale.update(torch.zeros(()))
    return StepOutput(loss=value, metrics=_norm_metric(norm))


def _read_result(
    step: int, stats: torch.Tensor, rules: StepRules, hint: str, scaled: bool
) -> StepOutput:
    """The deferred result of a step ended on the device: reads [loss, flag(, norm)] on the
    host in one copy."""
    value, flag, *norm = stats.tolist()
    if not math.isfinite(value) or flag > 0:  # the update was a no-op on the device
        return _outcome(step, value, flag > 0, rules, hint, scaled)
    return StepOutput(loss=value, metrics={"grad_norm": norm[0]} if norm else {})


# [Note: grad_norm]
# The global gradient norm before clipping, as torch's clip_grad_norm_ returns it, is logged as
# ``grad_norm`` in every record of a step that clips (``optim.grad_clip > 0``, the default): the
# clip computes it anyway. On the device path it travels with the step's [loss, flag] and is
# read when the record is written; without clipping it is not computed, so not logged. A sync
# parameter server clips on its servers (its workers push unclipped gradients and log none);
# an asynchronous worker clips its own gradient and logs that norm.
def _norm_metric(norm: torch.Tensor | None) -> dict[str, float]:
    return {"grad_norm": float(norm)} if norm is not None else {}


def _outcome(
    step: int, value: float, bad_grad: bool, rules: StepRules, hint: str, scaled: bool
) -> StepOutput:
    """A non-finite step's result; under loss scaling a gradient overflow with a finite loss is
    a skipped step whatever ``on_nonfinite`` says ([Note: dynamic loss scaling])."""
    if scaled and math.isfinite(value):
        return StepOutput(loss=value, skipped=True)
    return nonfinite_outcome(step, value, bad_grad, rules, hint=hint)


def all_finite(flat: torch.Tensor) -> bool:
    """Whether every element is finite, without a mask the size of the shard.

    A sum is NaN or infinite if any element is, so a finite sum in the buffer's own dtype
    answers at once (one fast pass); only a non-finite one, which may also be an overflow of
    finite values, is checked again with a float64 sum, which cannot overflow on float32 (or
    narrower) values and so is finite if and only if every element is."""
    if bool(torch.isfinite(flat.sum())):
        return True
    if flat.dtype == torch.float64:
        return bool(torch.isfinite(flat).all())
    return bool(torch.isfinite(flat.sum(dtype=torch.float64)))


def norm_and_finite(flat: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The 2-norm of a flat buffer, and whether every element of it is finite.

    [Note: the server's clip norm]
    A parameter server clips by the norm of its whole gradient shard on every sync step's
    critical path. One float32 pass takes 0.09 ms on the default job's 0.83M elements, against
    0.35-0.59 ms for ``vector_norm(dtype=float64)``. A finite float32 norm means every element
    is finite, so the step needs no separate finiteness pass; a non-finite one is either a
    NaN/Inf element (`all_finite` tells) or the sum of squares overflowing float32, and then
    the float64 norm, which cannot overflow on float32 values, replaces it."""
    norm = torch.linalg.vector_norm(flat)
    if bool(torch.isfinite(norm)):
        return norm, True
    if not all_finite(flat):
        return norm, False
    return torch.linalg.vector_norm(flat, dtype=torch.float64), True

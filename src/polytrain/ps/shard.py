"""A parameter server's shard: its parameters, its optimizer, its clocks, and the update.

`ServerShard` is the state `polytrain.ps.server.ParameterServer` serves: the shard as one flat
buffer with parameter views into it, the optimizer over them, the workers' clock table (and in
sync mode the aggregator of a clock's pushes), and the update made from the pushes' gradient
(clip by the norm over every server's shard, skip or stop on NaN). The server adds the
messages: receiving, answering, and who is live. Shapes: P = elements of this server's shard.

[Note: gradient scale] Every pusher sends the sum of its workers' mean gradients times
``num_pushers / num_workers`` (a worker alone: its own gradient). sync sums one clock's pushes
and divides by their number: the global-batch mean, as in the single-process run. async and
ssp apply each push divided by ``num_pushers``: for SGD that is lr / num_workers per worker
gradient, so one round of pushes moves the weights as far as one synchronous step (Downpour
with a scaled learning rate); Adam normalizes the scale away and takes one full step per push.

[Note: fused server optimizer] A sync server's update sits on every step's critical path: the
workers wait for it between their last push and their first pull. torch's default AdamW on the
CPU loops over the shard's tensors in Python, about ten kernels each; the fused kernel makes
one pass over every tensor. On the default job's shard (69 tensors, 0.83M elements, 2-core VM,
one thread) the step took 3.3 ms looped, 2.3 ms with foreach, 0.64 ms fused. The fused kernel
is the same AdamW (or SGD) with a different order of float operations, so a server's
parameters match the single-process run's to rounding, like any change of summation order (the
parity tests compare at 1e-5). The parameters stay views of the flat buffer, so the
optimizer's state and checkpoints are per parameter as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from polytrain.comm import ps_wire
from polytrain.config.job import OptimConfig
from polytrain.core.optim import build_optimizer
from polytrain.core.step import all_finite, clip_coefficient, norm_and_finite
from polytrain.core.strategy import NonFiniteLossError
from polytrain.ps.consistency import ApplyRule, ClockTable, Mode, SyncAggregator, apply_rule
from polytrain.ps.layout import ShardLayout
from polytrain.ps.stats import ServerStats

__all__ = ["ServerShard"]


class ServerShard:
    """Shard ``index`` of ``layout``, started from ``initial``, updated by the pushes of
    ``workers`` (``num_pushers`` push in all; ``server_group``: every server, for the clip
    norm). ``lr_at(clock)`` gives the learning rate of an update made from clock ``clock``."""

    def __init__(
        self,
        *,
        index: int,
        layout: ShardLayout,
        initial: dict[str, torch.Tensor],
        optim: OptimConfig,
        lr_at: Callable[[int], float],
        mode: Mode,
        staleness: int,
        workers: list[int],
        num_pushers: int,
        server_group: Any = None,
        on_nonfinite: Literal["stop", "skip"] = "stop",
    ) -> None:
        self.index, self.layout, self.mode, self.staleness = index, layout, mode, staleness
        self.lr_at, self.optim_cfg = lr_at, optim
        self.num_pushers, self.server_group = num_pushers, server_group
        self.on_nonfinite = on_nonfinite
        self.spans = layout.spans(index)
        numel = layout.numel(index)
        # Parameters are views of one flat buffer, so a pull sends slices of it without a copy.
        self.flat = layout.flatten(initial, index).clone()
        self.grad_flat = torch.zeros_like(self.flat)
        views = layout.unflatten(self.flat, index)
        grads = layout.unflatten(self.grad_flat, index)
        self.params: dict[str, nn.Parameter] = {}
        for name, view in views.items():
            param = nn.Parameter(view)
            param.grad = grads[name]
            self.params[name] = param
        # [Note: fused server optimizer]
        self.optimizer = build_optimizer(self.params.values(), optim, fused=True)
        self.rule = apply_rule(mode, staleness)
        self.table = ClockTable(workers)
        self.aggregator = SyncAggregator(workers) if self.rule is ApplyRule.SUM_THEN_APPLY else None
        # sync: clocks whose update is made (or dropped); set after the optimizer step, so a
        # colocated rank's checkpointer waits on it ([Note: colocated checkpoints]).
        self.applied = 0
        self.sum_flat = torch.zeros(numel, dtype=self.flat.dtype)
        self.stats = ServerStats()

    # [Note: gradient scale]: sync divides the clock's sum by the pushes in it (here); async
    # and ssp divide each push by ``num_pushers`` as it arrives (`ParameterServer._clock`).
    def _apply_sum(self) -> None:
        assert self.aggregator is not None
        clock = self.aggregator.clock
        window = self.stats.window(clock)
        window.apply_start = time.perf_counter()
        count = self.aggregator.finish()
        torch.div(self.sum_flat, count, out=self.grad_flat)
        finite = None
        if self.optim_cfg.grad_clip > 0:
            # Clip by the norm of the whole gradient, summed over every server's shard
            # ([Note: the server's clip norm]).
            norm, finite = norm_and_finite(self.grad_flat)
            square = norm.to(torch.float64).square().reshape(1)
            if self.server_group is not None:
                ps_wire.all_reduce_sum(square, self.server_group)
            coef = clip_coefficient(self.optim_cfg.grad_clip, square.sqrt()[0])
            finite = finite and bool(torch.isfinite(coef))  # another server's NaN
            if not bool(coef == 1.0):  # x * 1.0 == x exactly: skip a pass, same bits
                self.grad_flat.mul_(coef.to(self.grad_flat.dtype))
        self._step(clock, finite)
        window.apply_end = time.perf_counter()
        self.sum_flat.zero_()  # for the next step's pushes, after the update is made
        self.applied = clock + 1

    def _step(self, clock: int, finite: bool | None = None) -> None:
        """The optimizer step on this shard's gradient; ``finite``: known already (the clip
        norm's pass), else checked here."""
        if not (all_finite(self.grad_flat) if finite is None else finite):
            self._nonfinite(clock)
            return
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(clock)
        self.optimizer.step()
        self.stats.updates += 1

    def _nonfinite(self, clock: int) -> None:
        """[Note: parameter-server NaN] in `polytrain.ps.strategy`: stop, or drop and count."""
        if self.on_nonfinite == "stop":
            raise NonFiniteLossError(
                f"server {self.index}: the update of step {clock + 1} is NaN/Inf: lower "
                "optim.lr, enable optim.grad_clip, or set train.on_nonfinite = 'skip'"
            )
        self.stats.skipped.append(clock)

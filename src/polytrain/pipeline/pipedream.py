"""`PipeDreamStrategy`: one stage of a PipeDream pipeline (weight stashing, no flush).

PipeDream (Narayanan et al. SOSP 2019) with the PipeDream-2BW update rule (Narayanan et al.
ICML 2021) as the default: the stage runs one endless 1F1B micro-batch stream from the step it
starts at to the end of training, sliced into steps for the loop; the weights a micro-batch's
forward used are stashed until its backward (`runtime.WeightStash`). The synchronous schedules
and everything both share (stages, partition, evaluation, weights) live in
`pipeline.strategy.PipelineStrategy`; see docs/pipeline.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from polytrain.comm.collectives import all_reduce_mean_flat_, all_reduce_sum_async_
from polytrain.config.job import JobConfig
from polytrain.core.modules import train_mode
from polytrain.core.step import apply_update, nonfinite_flag, nonfinite_outcome
from polytrain.core.strategy import StepOutput
from polytrain.models.base import BlockModel
from polytrain.pipeline.runtime import WeightStash, crossing_updates
from polytrain.pipeline.schedule import Action, ActionKind, stash_bound
from polytrain.pipeline.strategy import SYNC_ONLY, PipelineStrategy

__all__ = ["PipeDreamStrategy"]


def _stream_index(first_step: int, per_step: int, microbatch: int) -> tuple[int, int]:
    """(step, micro-batch of the step) of micro-batch ``microbatch`` of a PipeDream stream."""
    return first_step + microbatch // per_step, microbatch % per_step


@dataclass
class _Stream:
    """A PipeDream micro-batch stream from step ``first_step`` to the end of training."""

    first_step: int
    program: list[Action]
    ends: list[int]  # program index after each step's slice
    next_step: int

    def slice(self, step: int) -> tuple[list[Action], bool]:
        r = step - self.first_step
        start = self.ends[r - 1] if r else 0
        return self.program[start : self.ends[r]], r == len(self.ends) - 1


class PipeDreamStrategy(PipelineStrategy):
    """One stage of a PipeDream pipeline: updates inside the stream, weight versions stashed."""

    stash: WeightStash

    def _init_runtime(self, job: JobConfig, model: BlockModel) -> None:
        # An update after every micro-batch, or once per step (PipeDream-2BW).
        per_micro = job.pipeline.pipedream_update == "microbatch"
        self.update_every = 1 if per_micro else self.per_step
        bound = stash_bound(self.stage_index, self.num_stages, self.update_every)
        self.stash = WeightStash(dict(self.stage.named_parameters()), bound)
        self.runtime = self._make_runtime(model, self.stash, after_backward=self._update)
        self._stream: _Stream | None = None
        self._bad_grad = torch.zeros((), device=self.device)  # a non-finite update seen

    def _start_stream(self, step: int) -> _Stream:
        per_step = self.per_step
        num_steps = max(self.job.train.steps - step, 1)
        program = self._stage_program("pipedream", num_steps * per_step)
        self.stash.crossing = crossing_updates(program, self.update_every)
        position = {a: n for n, a in enumerate(program)}
        s = self.stage_index
        ends: list[int] = []
        for r in range(num_steps - 1):
            end = position[Action(s, ActionKind.B, (r + 1) * per_step - 1)] + 1
            ends.append(end + (1 if s > 0 else 0))  # SEND_B follows its B
        ends.append(len(program))
        return _Stream(step, program, ends, step)

    def train_step(self, step: int) -> StepOutput:
        train_mode(self.stage)
        if self._stream is None or self._stream.next_step != step:
            assert self._stream is None or self.runtime.in_flight == 0, "stream restarted mid-way"
            self._stream = self._start_stream(step)
        stream = self._stream
        actions, last = stream.slice(step)
        per_step = self.per_step
        first = stream.first_step
        scale = 1.0 / self.update_every  # the update's gradient is its micro-batches' mean
        feed = self._feed(partial(_stream_index, first, per_step), scale, step)
        loss = self.runtime.run(actions, feed)
        if last:
            self.runtime.finish()
            self._stream = None
        else:
            # Every send of the slice has a matching receive in the peers' slices, except the
            # last activation (the next step's micro-batch): wait for all sends before it.
            pending = self.runtime.pending
            pending.wait_first(
                self.runtime.last_send_f if self.next_rank is not None else len(pending)
            )
            stream.next_step = step + 1
        bad, self._bad_grad = self._bad_grad, torch.zeros((), device=self.device)
        # Not waited for here: a world collective would end the stream's overlap every step
        # ([Note: deferred step results] in core.strategy).
        wait = all_reduce_sum_async_(torch.stack([loss.float(), bad]), None)

        def complete() -> StepOutput:
            stats = wait()
            value, bad = float(stats[0]) / self.dp / (scale * per_step), float(stats[1]) > 0
            if not math.isfinite(value) or bad:  # the update is applied: no skip (checks.py)
                return nonfinite_outcome(step, value, bad, self.rules, hint=SYNC_ONLY)
            return StepOutput(loss=value)

        return StepOutput(loss=math.nan, complete=complete)

    def _update(self, microbatch: int) -> None:
        """After every ``update_every``-th backward: apply the accumulated gradient."""
        if (microbatch + 1) % self.update_every:
            return
        with self.tracer.span("optimizer", cat="optim", microbatch=microbatch):
            grads = self._grads()
            if self.dp > 1:
                all_reduce_mean_flat_(grads, self.mesh.group("dp"))
            # Reported (and the run stopped) at the end of this step.
            flag = nonfinite_flag(self.stage.parameters(), self.device)
            self._bad_grad = torch.maximum(self._bad_grad, flag)
            # Clipped per stage: a global norm would need a collective across stages that run
            # asynchronously ([Note: pipeline and data parallel]).
            apply_update(list(self.stage.parameters()), self.rules, optimizer=self.optimizer)
            self.optimizer.zero_grad(set_to_none=True)
            self.stash.version += 1

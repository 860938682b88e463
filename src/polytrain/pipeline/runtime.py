"""The stage interpreter: run one rank's lowered action list over `comm.p2p` (schedules as data).

GPipe (Huang et al. 2019) and 1F1B / PipeDream-flush (Narayanan et al. 2021) differ only in the
action list they hand to `StageRuntime.run`; PipeDream (Narayanan et al. SOSP 2019) adds a
`WeightStash` and an update after every backward. The interpreter keeps, per micro-batch in
flight, the stage's input (for its gradient), its output (for backward) and, on the last stage,
the loss.

[Note: loss scale] The last stage scales micro-batch ``i``'s loss (a mean over its samples) by
``scale`` before backward: ``1 / m`` for a synchronous step of ``m`` micro-batches, so the
accumulated gradients equal the gradients of the full-batch mean loss, and ``1`` for
PipeDream, which updates on each micro-batch's own gradient.

[Note: activation accounting] With ``track_activations`` the runtime counts the bytes autograd
saves during each forward (`pipeline.saved_tensors.count_saved_bytes`, the profile's counter too;
weights, stashed versions and tensors shared with an earlier save are not counted), adds them to a live total when the forward runs and subtracts
them after its backward. ``peak_activation_bytes`` is the high-water mark: the activation memory
a schedule really holds, which is ``m`` micro-batches for GPipe and at most ``p - s`` for 1F1B.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from polytrain.comm.p2p import P2P, PendingSends, Work
from polytrain.core.loss_scale import LossScale
from polytrain.models.base import LossFn, to_device
from polytrain.observe.trace import Tracer
from polytrain.pipeline.layer_stage import LayerStage
from polytrain.pipeline.saved_tensors import count_saved_bytes, storage_keys
from polytrain.pipeline.schedule import Action, ActionKind
from polytrain.pipeline.stage import StageModule

__all__ = [
    "ACT",
    "GRAD",
    "Feed",
    "StageRuntime",
    "WeightStash",
    "crossing_updates",
]

ACT, GRAD = "act", "grad"  # p2p channel names of activations (forward) and gradients (backward)


@dataclass
class Feed:
    """Where the first stage's inputs and the last stage's targets of micro-batch ``i`` come from."""

    inputs: Callable[[int], torch.Tensor]
    targets: Callable[[int], torch.Tensor]
    scale: float
    """Factor of every micro-batch loss; see [Note: loss scale]."""
    step: int = 0
    """Step number recorded in trace spans."""
    context: Callable[[int], Any] | None = None
    """Micro-batch ``i``'s model inputs for every stage of a layer pipeline (`LayerStage`)."""


def crossing_updates(actions: Sequence[Action], update_every: int) -> set[int]:
    """Micro-batches of ``actions`` (one stage's program) whose backward follows an update that
    came after their forward: the only ones that need a stashed copy of the weights.

    The update follows the backward of every micro-batch ``j`` with ``(j + 1) % update_every
    == 0`` (PipeDream's rule in `PipelineStrategy`); every other micro-batch runs forward and
    backward on one unchanged set of live weights ([Note: live forwards]).
    """
    in_flight: set[int] = set()
    crossing: set[int] = set()
    for action in actions:
        i = action.microbatch_index
        if action.kind is ActionKind.F:
            in_flight.add(i)
        elif action.kind is ActionKind.B:
            in_flight.discard(i)
            if (i + 1) % update_every == 0:
                crossing |= in_flight
    return crossing


class WeightStash:
    """PipeDream weight stashing: each micro-batch's backward uses its forward's weight version.

    ``version`` counts the updates applied to the stage's live weights. `forward` returns a
    snapshot of the live weights for micro-batch ``i`` (one snapshot per version, shared by every
    micro-batch that runs forward on it) and `release` drops a snapshot when no micro-batch in
    flight uses it. Snapshots are detached copies that require grad, so the optimizer's in-place
    updates of the live weights never touch a tensor an autograd graph saved.

    [Note: live forwards] A micro-batch with no update between its forward and its backward
    (not in ``crossing``, see `crossing_updates`) needs no copy: `forward` returns None and it
    runs on the live parameters like a synchronous schedule, with autograd accumulating into
    ``.grad``. Copies (and the slower functional call on them) are left to the micro-batches
    that cross an update: with one update per step (PipeDream-2BW) the first ``p - 1 - s`` of
    each step on stage ``s``. The versions are the same as with a copy for every micro-batch.
    """

    def __init__(self, params: dict[str, torch.nn.Parameter], bound: int) -> None:
        self.params = params
        self.bound = bound
        self.version = 0
        self.crossing: set[int] | None = None
        """Micro-batches that need a copy; None: every micro-batch gets one."""
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self._users: dict[int, int] = {}
        self.version_of: dict[int, int] = {}
        self._live: set[int] = set()
        self.max_stashed = 0
        self.log: list[tuple[int, int, int]] = []
        """(micro-batch, version its forward used, version its backward used), in backward order."""

    def forward(self, microbatch: int) -> dict[str, torch.Tensor] | None:
        v = self.version
        if self.crossing is not None and microbatch not in self.crossing:
            self.version_of[microbatch] = v
            self._live.add(microbatch)
            return None
        if v not in self.snapshots:
            self.snapshots[v] = {
                n: p.detach().clone().requires_grad_(p.requires_grad)
                for n, p in self.params.items()
            }
            self._users[v] = 0
        self._users[v] += 1
        self.version_of[microbatch] = v
        self.max_stashed = max(self.max_stashed, len(self.snapshots))
        assert len(self.snapshots) <= self.bound, (
            f"{len(self.snapshots)} weight versions stashed, more than the bound {self.bound}"
        )
        return self.snapshots[v]

    def backward_weights(self, microbatch: int) -> tuple[int, dict[str, torch.Tensor] | None]:
        """The version micro-batch ``i``'s backward runs on, and its copy (None: the live one)."""
        if microbatch in self._live:
            return self.version, None
        v = self.version_of[microbatch]
        return v, self.snapshots[v]

    def release(self, microbatch: int, used_version: int) -> None:
        v = self.version_of.pop(microbatch)
        self.log.append((microbatch, v, used_version))
        if microbatch in self._live:
            self._live.discard(microbatch)
            return
        self._users[v] -= 1
        if self._users[v] == 0:
            del self.snapshots[v], self._users[v]


class _Receives:
    """Receives posted ahead on each channel, as many as the stage holds micro-batches in flight
    ([Note: early receives]).

    [Note: early receives] A receive is posted before the stage reaches it, so its message
    travels while this stage computes instead of when the stage gets there
    (torch.distributed.pipelining posts each receive just before it is needed), and the sender
    finds it posted: gloo moves a message whose receive is not posted only after the receiver's
    "ready" notice, one more trip between processes ([Note: posted receives] in comm/probe.py).
    Each channel keeps ``depth`` receives posted, the most micro-batches this stage's program
    holds between a forward and its backward: GPipe's m, so its stage takes its neighbour's
    burst of m sends as they come, and 1F1B's at most p - s, so its buffers stay within the
    activations it holds anyway. One ahead (what this was before) let GPipe's later sends meet
    receives not yet posted: mlp tiny's pp2 GPipe m4 step took 9.0-11.0 ms, with all four
    posted 5.0-7.8 (3 rounds each, `benchmarks/planner/main.py --models mlp --layouts
    pp2-gpipe-m4`, 2026-11-26; 1F1B and PipeDream, 6.1-7.9 and 4.8-6.7 before, unchanged
    within the noise). Receives on a channel are posted in program order, which is the sender's
    order, so matching is unchanged. A channel whose shape handshake has not happened yet is
    never posted early: its header receive blocks, and blocking ahead of program order could
    deadlock. Only receives of ``actions`` are posted, so none is left over at the end.
    """

    def __init__(self, runtime: StageRuntime, actions: Sequence[Action]) -> None:
        self.runtime = runtime
        self.order: dict[ActionKind, list[Action]] = {ActionKind.RECV_F: [], ActionKind.RECV_B: []}
        for action in actions:
            if action.kind in self.order:
                self.order[action.kind].append(action)
        self.depth = max(_most_in_flight(actions), 1)
        self.cursor = {kind: 0 for kind in self.order}
        self.posted: dict[Action, tuple[torch.Tensor, Work | None]] = {}
        for kind in self.order:
            self._post_next(kind)

    def _peer(self, kind: ActionKind) -> tuple[int, str]:
        peer = self.runtime.prev_rank if kind is ActionKind.RECV_F else self.runtime.next_rank
        assert peer is not None, f"stage {self.runtime.stage_index} has no peer for {kind.value}"
        return peer, ACT if kind is ActionKind.RECV_F else GRAD

    def _post_next(self, kind: ActionKind) -> None:
        """Post the channel's next receives not yet posted, up to ``depth`` ahead."""
        queue, n = self.order[kind], self.cursor[kind]
        if n >= len(queue):
            return
        peer, channel = self._peer(kind)
        for action in queue[n : n + self.depth]:
            if action in self.posted:
                continue
            if not self.runtime.p2p.knows(peer, channel):
                return
            self.posted[action] = self.runtime.p2p.irecv(peer, channel)

    def take(self, action: Action) -> torch.Tensor:
        kind = action.kind
        assert self.order[kind][self.cursor[kind]] == action, f"{action} out of order"
        if action in self.posted:
            buffer, work = self.posted.pop(action)
        else:
            buffer, work = self.runtime.p2p.irecv(*self._peer(kind))
        if work is not None:
            work.wait()
        self.cursor[kind] += 1
        self._post_next(kind)
        return buffer

    def check_drained(self) -> None:
        assert not self.posted, f"receives posted but never taken: {sorted(map(str, self.posted))}"


def _most_in_flight(actions: Sequence[Action]) -> int:
    """The most micro-batches between their forward and their backward at once in ``actions``."""
    live = most = 0
    for action in actions:
        if action.kind is ActionKind.F:
            live += 1
            most = max(most, live)
        elif action.kind is ActionKind.B:
            live -= 1
    return most


@dataclass
class _InFlight:
    """What one micro-batch holds on this stage between its forward and its backward."""

    input: torch.Tensor | None = None
    output: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    output_grad: torch.Tensor | None = None
    input_grad: torch.Tensor | None = None
    activation_bytes: int = 0


@dataclass
class _Stats:
    live_activation_bytes: int = 0
    peak_activation_bytes: int = 0


class StageRuntime:
    """Interprets F, B, SEND_F, RECV_F, SEND_B and RECV_B actions for one pipeline stage."""

    def __init__(
        self,
        stage: StageModule | LayerStage,
        stage_index: int,
        num_stages: int,
        p2p: P2P,
        *,
        prev_rank: int | None,
        next_rank: int | None,
        loss_fn: LossFn,
        tracer: Tracer,
        device: torch.device,
        autocast_dtype: torch.dtype | None = None,
        stash: WeightStash | None = None,
        after_backward: Callable[[int], None] | None = None,
        track_activations: bool = False,
    ) -> None:
        self.stage, self.stage_index, self.num_stages = stage, stage_index, num_stages
        self.p2p, self.prev_rank, self.next_rank = p2p, prev_rank, next_rank
        self.loss_fn, self.tracer, self.device = loss_fn, tracer, device
        self.autocast_dtype = autocast_dtype
        self.stash = stash
        self.after_backward = after_backward
        self.track_activations = track_activations
        self.pending = PendingSends()
        self.last_send_f = 0  # index in `pending` of the latest activation send's works
        self.stats = _Stats()
        self._flight: dict[int, _InFlight] = {}
        self._params = dict(stage.named_parameters())
        # fp16's factor: the last stage's backward starts from the scaled loss ([Note: dynamic
        # loss scaling] in polytrain.core.loss_scale); set by the strategy that owns it.
        self.loss_scale: LossScale | None = None

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def in_flight(self) -> int:
        return len(self._flight)

    def run(self, actions: Sequence[Action], feed: Feed) -> torch.Tensor:
        """Run ``actions`` in order; return the sum of the scaled losses (0 off the last stage)."""
        loss_sum = torch.zeros((), device=self.device)
        receives = _Receives(self, actions)
        for action in actions:
            i = action.microbatch_index
            kind = action.kind
            cat = "compute" if action.is_compute else "comm"
            with self.tracer.span(
                kind.value, cat=cat, microbatch=i, stage=self.stage_index, step=feed.step
            ):
                if kind is ActionKind.F:
                    loss = self._forward(i, feed)
                    if loss is not None:
                        loss_sum += loss.detach()
                elif kind is ActionKind.B:
                    self._backward(i)
                elif kind is ActionKind.SEND_F:
                    output = self._flight[i].output
                    assert output is not None and self.next_rank is not None
                    self.last_send_f = len(self.pending)
                    self.p2p.isend(output, self.next_rank, ACT, self.pending)
                elif kind is ActionKind.RECV_F:
                    x = receives.take(action)
                    self._flight.setdefault(i, _InFlight()).input = x.requires_grad_(
                        x.is_floating_point()
                    )
                elif kind is ActionKind.RECV_B:
                    self._flight[i].output_grad = receives.take(action)
                elif kind is ActionKind.SEND_B:
                    assert self.prev_rank is not None
                    state = self._flight.pop(i)
                    if state.input_grad is None:  # the stage's input needed no gradient
                        assert state.input is not None
                        state.input_grad = torch.zeros_like(state.input)
                    self.p2p.isend(state.input_grad, self.prev_rank, GRAD, self.pending)
                    if self.after_backward is not None:
                        self.after_backward(i)
        receives.check_drained()
        return loss_sum

    def _autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _forward(self, i: int, feed: Feed) -> torch.Tensor | None:
        state = self._flight.setdefault(i, _InFlight())
        if self.is_first:
            state.input = to_device(feed.inputs(i), self.device)
        x = state.input
        assert x is not None
        weights = self.stash.forward(i) if self.stash is not None else None
        if feed.context is not None and isinstance(self.stage, LayerStage):
            self.stage.set_context(feed.context(i))  # it runs the model's own forward
        with self._count_saved(state), self._autocast():
            out = self.stage(x, weights)
            if self.is_last:
                state.loss = self.loss_fn(out, to_device(feed.targets(i), self.device)) * feed.scale
            else:
                state.output = out
        self.stats.live_activation_bytes += state.activation_bytes
        self.stats.peak_activation_bytes = max(
            self.stats.peak_activation_bytes, self.stats.live_activation_bytes
        )
        return state.loss

    def _backward(self, i: int) -> None:
        state = self._flight[i]
        root = state.loss if self.is_last else state.output
        assert root is not None
        if self.is_last and self.loss_scale is not None:
            root = self.loss_scale.scaled(root)
        grad = None if self.is_last else state.output_grad
        x = state.input
        wants_input_grad = x is not None and x.requires_grad and not self.is_first
        version, weights = self.stash.backward_weights(i) if self.stash else (0, None)
        if weights is not None:
            names = [n for n, t in weights.items() if t.requires_grad]
            targets = [weights[n] for n in names] + (
                [x] if wants_input_grad and x is not None else []
            )
            if root.requires_grad and targets:
                grads = torch.autograd.grad(
                    root, targets, grad_outputs=grad, allow_unused=True, materialize_grads=True
                )
            else:
                grads = tuple(torch.zeros_like(t) for t in targets)
            for n, g in zip(names, grads, strict=False):  # accumulate until the update
                param = self._params[n]
                param.grad = g if param.grad is None else param.grad.add_(g)
            if wants_input_grad:
                state.input_grad = grads[-1]
        else:
            if root.requires_grad:
                torch.autograd.backward(root, grad_tensors=grad)
            if wants_input_grad and x is not None:
                state.input_grad = x.grad
        if self.stash is not None:
            self.stash.release(i, version)
        state.output = state.loss = state.output_grad = None
        self.stats.live_activation_bytes -= state.activation_bytes
        if self.is_first:  # no gradient to send: the micro-batch is done here
            self._flight.pop(i)
            if self.after_backward is not None:
                self.after_backward(i)

    @contextlib.contextmanager
    def _count_saved(self, state: _InFlight) -> Iterator[None]:
        if not self.track_activations:
            yield
            return
        weights = storage_keys(self.stage.parameters())
        if self.stash is not None:
            for snapshot in self.stash.snapshots.values():
                weights |= storage_keys(snapshot.values())
        with count_saved_bytes(weights) as saved:
            yield
        state.activation_bytes += saved.bytes

    def finish(self) -> None:
        """Wait for every send posted so far (end of a synchronous step)."""
        self.pending.wait()
        assert not self._flight, f"micro-batches still in flight: {sorted(self._flight)}"

    def forward_only(self, x: torch.Tensor) -> Any:
        """Evaluation forward on the live weights (no graph); the last stage may return a dict."""
        with torch.no_grad(), self._autocast():
            return self.stage(x.to(self.device))

"""The stage interpreter: run one rank's lowered action list over `comm.p2p` (schedules as data).

GPipe (Huang et al. 2019), 1F1B / PipeDream-flush (Narayanan et al. 2021), interleaved 1F1B
(Narayanan et al. SC'21) and the zero-bubble ZB-H1 and ZBV (Qi et al. ICLR 2024) differ only in
the action list they hand to `StageRuntime.run` and in the stages a rank holds (`StageMap`);
PipeDream (Narayanan et al. SOSP 2019) adds a `WeightStash` and an update after every backward.
The interpreter keeps, per stage and micro-batch in flight, the stage's input (for its
gradient), its output (for backward) and, on the last stage, the loss.

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from polytrain.comm.p2p import P2P, PendingSends, Work
from polytrain.core.loss_scale import LossScale
from polytrain.models.base import LossFn, to_device
from polytrain.observe.trace import Tracer
from polytrain.pipeline.backward_split import PendingWeights, backward_input, backward_weight
from polytrain.pipeline.layer_stage import LayerStage
from polytrain.pipeline.saved_tensors import count_saved_bytes, storage_keys
from polytrain.pipeline.schedule import Action, ActionKind, P2PMessage, StageMap, p2p_message
from polytrain.pipeline.stage import StageModule

__all__ = [
    "ACT",
    "GRAD",
    "Feed",
    "StageRuntime",
    "WeightStash",
    "channel_name",
    "crossing_updates",
    "training_p2p",
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
    """Receives posted ahead on each channel, as many as the rank holds micro-batches in flight
    ([Note: early receives]).

    [Note: early receives] A receive is posted before the stage reaches it, so its message
    travels while this stage computes instead of when the stage gets there
    (torch.distributed.pipelining posts each receive just before it is needed), and the sender
    finds it posted: gloo moves a message whose receive is not posted only after the receiver's
    "ready" notice, one more trip between processes ([Note: posted receives] in comm/probe.py).
    Each channel keeps ``depth`` receives posted, the most micro-batches this rank's program
    holds between a forward and the end of its backward: GPipe's m, so its stage takes its
    neighbour's burst of m sends as they come, and 1F1B's at most p - s, so its buffers stay
    within the activations it holds anyway. One ahead (what this was before) let GPipe's later
    sends meet receives not yet posted: mlp tiny's pp2 GPipe m4 step took 9.0-11.0 ms, with all
    four posted 5.0-7.8 (3 rounds each, `benchmarks/planner/main.py --models mlp --layouts
    pp2-gpipe-m4`, 2026-11-26; 1F1B and PipeDream, 6.1-7.9 and 4.8-6.7 before, unchanged
    within the noise).

    A channel is `P2PMessage.channel`: one direction of one rank pair for one kind of tensor.
    With several stages per rank it carries several stages' messages, each stage boundary
    under its own p2p name (its own shape handshake, [Note: channel shapes] in comm/p2p.py),
    all on one process group, where messages match in the order they are posted. So receives
    are posted in the channel's program order, which is the sender's (`validate` checks it
    across stages), and posting stops at a receive whose name has not had its handshake yet:
    its header receive blocks, and blocking ahead of program order could deadlock. Only
    receives of ``actions`` are posted, so none is left over at the end.
    """

    def __init__(self, runtime: StageRuntime, actions: Sequence[Action]) -> None:
        self.p2p = runtime.p2p
        self.order: dict[tuple[str, int, int], list[Action]] = {}
        self.source: dict[Action, tuple[tuple[str, int, int], int, str]] = {}
        for action in actions:
            if action.kind not in (ActionKind.RECV_F, ActionKind.RECV_B):
                continue
            message = p2p_message(action, runtime.stage_map)
            assert message is not None
            self.order.setdefault(message.channel, []).append(action)
            peer = runtime.pp_ranks[message.src_rank]
            self.source[action] = (message.channel, peer, channel_name(message))
        self.depth = max(_most_in_flight(actions), 1)
        self.cursor = {channel: 0 for channel in self.order}
        self.posted: dict[Action, tuple[torch.Tensor, Work | None]] = {}
        for channel in self.order:
            self._post_next(channel)

    def _post_next(self, channel: tuple[str, int, int]) -> None:
        """Post the channel's next receives not yet posted, up to ``depth`` ahead."""
        queue, n = self.order[channel], self.cursor[channel]
        for action in queue[n : n + self.depth]:
            if action in self.posted:
                continue
            _, peer, name = self.source[action]
            if not self.p2p.knows(peer, name):
                return
            self.posted[action] = self.p2p.irecv(peer, name)

    def take(self, action: Action) -> torch.Tensor:
        channel, peer, name = self.source[action]
        assert self.order[channel][self.cursor[channel]] == action, f"{action} out of order"
        if action in self.posted:
            buffer, work = self.posted.pop(action)
        else:
            buffer, work = self.p2p.irecv(peer, name)
        if work is not None:
            work.wait()
        self.cursor[channel] += 1
        self._post_next(channel)
        return buffer

    def check_drained(self) -> None:
        assert not self.posted, f"receives posted but never taken: {sorted(map(str, self.posted))}"


def channel_name(message: P2PMessage) -> str:
    """The p2p name of a message: its kind of tensor and the stage that produced it, so each
    stage boundary and direction has its own shape handshake ([Note: channel shapes])."""
    return f"{ACT if message.tensor == 'activations' else GRAD}{message.src_stage}"


def training_p2p(act_group: Any, grad_group: Any, num_stages: int, device: torch.device) -> P2P:
    """Channels for training traffic: activations on ``act_group``, gradients on
    ``grad_group`` ([Note: one connection per direction] in comm/p2p.py)."""
    grads = {f"{GRAD}{s}": grad_group for s in range(num_stages)}
    return P2P(act_group, device, channel_groups=grads)


def _most_in_flight(actions: Sequence[Action]) -> int:
    """The most micro-batches between their forward and the end of their backward (B, or W
    after I) at once in ``actions``, over all the rank's stages."""
    live = most = 0
    for action in actions:
        if action.kind is ActionKind.F:
            live += 1
            most = max(most, live)
        elif action.kind in (ActionKind.B, ActionKind.W):
            live -= 1
    return most


@dataclass
class _InFlight:
    """What one micro-batch holds on one stage between its forward and its backward."""

    input: torch.Tensor | None = None
    output: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    output_grad: torch.Tensor | None = None
    weights: PendingWeights | None = None  # after I, what its W needs
    activation_bytes: int = 0


@dataclass
class _Stats:
    live_activation_bytes: int = 0
    peak_activation_bytes: int = 0


Stage = StageModule | LayerStage


class StageRuntime:
    """Interprets F, B, I, W, SEND_F, RECV_F, SEND_B and RECV_B for the stages of one rank.

    ``stages`` maps each stage index this rank holds (`StageMap.stages_of`) to its module;
    ``pp_ranks[r]`` is the global rank of pipeline rank ``r``. An action runs on the stage it
    names. [Note: local hand-off] in `schedule.lowering`: a stage whose neighbour is on this
    rank takes its input from the neighbour's output of the same micro-batch, and gives its
    input gradient straight to the neighbour, with no message; the boundary is cut exactly as
    by a send (`detach`, then ``requires_grad``), so each stage's backward stops at its input.

    A ``B`` is one ``backward``. Zero-bubble schedules split it: ``I`` computes the gradient
    of the stage's input only and records the gradients reaching the parameters' consumers,
    ``W`` later turns those into weight gradients (`pipeline.backward_split`, [Note: weight
    gradients from the consumers]); the gradients are ``B``'s, each computed once.
    """

    def __init__(
        self,
        stages: Mapping[int, Stage],
        stage_map: StageMap,
        pp_ranks: Sequence[int],
        p2p: P2P,
        *,
        loss_fn: LossFn,
        tracer: Tracer,
        device: torch.device,
        autocast_dtype: torch.dtype | None = None,
        stash: WeightStash | None = None,
        after_backward: Callable[[int], None] | None = None,
        before_backward: Callable[[int, int], None] | None = None,
        track_activations: bool = False,
    ) -> None:
        self.stages = dict(stages)
        self.stage_map, self.pp_ranks = stage_map, list(pp_ranks)
        self.num_stages = stage_map.num_stages
        self.p2p = p2p
        self.loss_fn, self.tracer, self.device = loss_fn, tracer, device
        self.autocast_dtype = autocast_dtype
        assert stash is None or len(self.stages) == 1, "weight stashing needs one stage per rank"
        self.stash = stash
        self.after_backward = after_backward
        # Called with (stage, micro-batch) before each B: ZeRO stages choose there whether this
        # backward reduce-scatters ([Note: ZeRO inside stages] in pipeline.sharded).
        self.before_backward = before_backward
        self.track_activations = track_activations
        self.pending = PendingSends()
        self.last_send_f = 0  # index in `pending` of the latest activation send's works
        self.stats = _Stats()
        self._flight: dict[tuple[int, int], _InFlight] = {}  # (stage, micro-batch) -> state
        self._input_grads: dict[tuple[int, int], torch.Tensor] = {}  # until SEND_B
        self._params = {
            s: [p for p in stage.parameters() if p.requires_grad] for s, stage in stages.items()
        }
        self._stash_params = (
            dict(next(iter(self.stages.values())).named_parameters()) if stash else {}
        )
        # fp16's factor: the last stage's backward starts from the scaled loss ([Note: dynamic
        # loss scaling] in polytrain.core.loss_scale); set by the strategy that owns it.
        self.loss_scale: LossScale | None = None

    def is_last(self, stage: int) -> bool:
        return stage == self.num_stages - 1

    @property
    def in_flight(self) -> int:
        return len(self._flight)

    def _peer(self, stage: int) -> int:
        """Global rank holding ``stage``."""
        return self.pp_ranks[self.stage_map.rank_of(stage)]

    def _is_local(self, stage: int, other: int) -> bool:
        return 0 <= other < self.num_stages and self.stage_map.is_local(stage, other)

    def run(self, actions: Sequence[Action], feed: Feed) -> torch.Tensor:
        """Run ``actions`` in order; return the sum of the scaled losses (0 off the last stage)."""
        loss_sum = torch.zeros((), device=self.device)
        receives = _Receives(self, actions)
        for action in actions:
            s, i, kind = action.stage_index, action.microbatch_index, action.kind
            cat = "compute" if action.is_compute else "comm"
            with self.tracer.span(kind.value, cat=cat, microbatch=i, stage=s, step=feed.step):
                if kind is ActionKind.F:
                    loss = self._forward(s, i, feed)
                    if loss is not None:
                        loss_sum += loss.detach()
                elif kind is ActionKind.B or kind is ActionKind.I:
                    if self.before_backward is not None:
                        self.before_backward(s, i)
                    self._backward(s, i, weights=kind is ActionKind.B)
                elif kind is ActionKind.W:
                    self._backward_weights(s, i)
                elif kind is ActionKind.SEND_F:
                    output = self._flight[(s, i)].output
                    assert output is not None
                    self.last_send_f = len(self.pending)
                    self._send(action, output)
                elif kind is ActionKind.RECV_F:
                    x = receives.take(action)
                    self._flight.setdefault((s, i), _InFlight()).input = x.requires_grad_(
                        x.is_floating_point()
                    )
                elif kind is ActionKind.RECV_B:
                    self._flight[(s, i)].output_grad = receives.take(action)
                elif kind is ActionKind.SEND_B:
                    self._send(action, self._input_grads.pop((s, i)))
                    if self.after_backward is not None:
                        self.after_backward(i)
        receives.check_drained()
        return loss_sum

    def _send(self, action: Action, tensor: torch.Tensor) -> None:
        message = p2p_message(action, self.stage_map)
        assert message is not None
        peer = self.pp_ranks[message.dst_rank]
        self.p2p.isend(tensor, peer, channel_name(message), self.pending)

    def _autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _forward(self, s: int, i: int, feed: Feed) -> torch.Tensor | None:
        state = self._flight.setdefault((s, i), _InFlight())
        if s == 0:
            state.input = to_device(feed.inputs(i), self.device)
        elif self._is_local(s, s - 1):  # [Note: local hand-off]
            out = self._flight[(s - 1, i)].output
            assert out is not None, f"{s - 1}F{i} ran on this rank before {s}F{i}"
            state.input = out.detach().requires_grad_(out.is_floating_point())
        x = state.input
        assert x is not None
        stage = self.stages[s]
        weights = self.stash.forward(i) if self.stash is not None else None
        if feed.context is not None and isinstance(stage, LayerStage):
            stage.set_context(feed.context(i))  # it runs the model's own forward
        with self._count_saved(stage, state), self._autocast():
            out = stage(x, weights)
            if self.is_last(s):
                state.loss = self.loss_fn(out, to_device(feed.targets(i), self.device)) * feed.scale
            else:
                state.output = out
        self.stats.live_activation_bytes += state.activation_bytes
        self.stats.peak_activation_bytes = max(
            self.stats.peak_activation_bytes, self.stats.live_activation_bytes
        )
        return state.loss

    def _root(self, s: int, state: _InFlight) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Where stage ``s``'s backward starts: (loss or output, its gradient or None)."""
        if self.is_last(s):
            assert state.loss is not None
            root = state.loss
            return (root if self.loss_scale is None else self.loss_scale.scaled(root)), None
        assert state.output is not None and state.output_grad is not None
        return state.output, state.output_grad

    def _backward(self, s: int, i: int, *, weights: bool) -> None:
        """``B`` (``weights``: input and weight gradients) or ``I`` (the input's only)."""
        state = self._flight[(s, i)]
        root, grad = self._root(s, state)
        x = state.input
        wants_input_grad = s > 0 and x is not None and x.requires_grad
        input_grad: torch.Tensor | None = None
        version, stashed = self.stash.backward_weights(i) if self.stash else (0, None)
        if not weights:
            input_grad, state.weights = backward_input(
                root, grad, x if wants_input_grad else None, self._params[s]
            )
        elif stashed is not None:
            names = [n for n, t in stashed.items() if t.requires_grad]
            targets = [stashed[n] for n in names] + (
                [x] if wants_input_grad and x is not None else []
            )
            if root.requires_grad and targets:
                grads = torch.autograd.grad(
                    root, targets, grad_outputs=grad, allow_unused=True, materialize_grads=True
                )
            else:
                grads = tuple(torch.zeros_like(t) for t in targets)
            for n, g in zip(names, grads, strict=False):  # accumulate until the update
                param = self._stash_params[n]
                param.grad = g if param.grad is None else param.grad.add_(g)
            if wants_input_grad:
                input_grad = grads[-1]
        else:
            if root.requires_grad:
                torch.autograd.backward(root, grad_tensors=grad)
            if wants_input_grad and x is not None:
                input_grad = x.grad
        if s > 0:
            if input_grad is None:  # the stage's input needed no gradient
                assert x is not None
                input_grad = torch.zeros_like(x)
            if self._is_local(s, s - 1):  # [Note: local hand-off]
                self._flight[(s - 1, i)].output_grad = input_grad
            else:
                self._input_grads[(s, i)] = input_grad
        if weights:
            if self.stash is not None:
                self.stash.release(i, version)
            self._done(s, i)
            if s == 0 and self.after_backward is not None:  # no gradient to send
                self.after_backward(i)

    def _backward_weights(self, s: int, i: int) -> None:
        """``W``: the weight gradients of ``sI i``, accumulated into ``.grad``."""
        pending = self._flight[(s, i)].weights
        assert pending is not None, f"{s}W{i} before {s}I{i}"
        backward_weight(pending)
        self._done(s, i)

    def _done(self, s: int, i: int) -> None:
        """Micro-batch ``i``'s backward is complete on stage ``s``: drop what it held."""
        state = self._flight.pop((s, i))
        self.stats.live_activation_bytes -= state.activation_bytes

    @contextlib.contextmanager
    def _count_saved(self, stage: Stage, state: _InFlight) -> Iterator[None]:
        if not self.track_activations:
            yield
            return
        weights = storage_keys(stage.parameters())
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
        assert not self._input_grads, f"gradients never sent: {sorted(self._input_grads)}"

    def forward_only(self, stage: int, x: torch.Tensor) -> Any:
        """Evaluation forward of ``stage`` on the live weights (no graph); the last stage may
        return a dict."""
        with torch.no_grad(), self._autocast():
            return self.stages[stage](x.to(self.device))

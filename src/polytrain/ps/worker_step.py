"""A parameter-server worker's side of one step: pull the parameters, compute the gradient, push.

`WorkerSteps` holds the methods `polytrain.ps.strategy.PSStrategy` runs on a worker rank
between the loop's calls: the pull of a clock's parameters (whole, or lazily into the forward
pre-hooks of [Note: prioritised overlap] in `polytrain.ps.overlap`), the forward and backward
over the micro-batches, and the push of the gradient, a NaN one for a dropped step ([Note:
parameter-server NaN] in `polytrain.ps.strategy`). The state it reads and advances (the
client, the clocks, the overlap's pusher and fetcher) is set up by `PSStrategy.__init__`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from polytrain.comm import ps_wire
from polytrain.config.job import JobConfig
from polytrain.core.microbatch import forward_backward
from polytrain.core.modules import train_mode
from polytrain.core.step import StepRules
from polytrain.data.sampler import Batches
from polytrain.models.base import BlockModel
from polytrain.observe.trace import Tracer
from polytrain.ps.layout import ShardLayout
from polytrain.ps.local import ColocatedServer
from polytrain.ps.overlap import GradPusher, ParamFetcher
from polytrain.ps.worker import PendingPull, PostedPull, WorkerClient

__all__ = ["WorkerSteps"]


class WorkerSteps:
    """A worker rank's pull, compute and push (mixed into `PSStrategy`, which sets the state
    below in its ``__init__``)."""

    job: JobConfig
    rank: int
    model: BlockModel
    batches: Batches
    tracer: Tracer
    rules: StepRules
    sync: bool
    layout: ShardLayout
    servers: list[int]
    num_workers: int
    host_group: Any  # ps.hierarchical: the group of this host's workers, else None
    leader: int
    is_pusher: bool
    push_scale: float
    client: WorkerClient | None
    pusher: GradPusher | None
    fetcher: ParamFetcher | None
    colocated: ColocatedServer | None
    joining: bool
    started: float
    clock: int
    fresh: int
    next_pull: PostedPull | None
    pending_pull: PendingPull | None
    last_metrics: dict[str, float]

    def _params(self) -> dict[str, nn.Parameter]:
        """The worker replica's parameters under the model's (layout's) names."""
        return dict(self.model.named_parameters())

    def _join(self) -> None:
        assert self.client is not None
        time.sleep(max(0.0, self.job.ps.join_delay_s - (time.monotonic() - self.started)))
        self.clock = self.client.join()
        self.joining = False

    def _ensure_params(self, clock: int, lazy: bool = False) -> None:
        """Hold the parameters for running ``clock`` (a pull, unless we already have them).

        ``lazy``: return once every server granted the pull; the forward pre-hooks of the
        `ParamFetcher` wait for each module's chunks ([Note: prioritised overlap])."""
        if self.fresh == clock:
            return
        t0 = time.perf_counter()
        if lazy:
            assert self.client is not None and self.fetcher is not None
            with self.tracer.span("pull-grant", cat="communication", step=clock):
                posted = self._posted_pull(clock) or self.client.post_pull(clock)
                # The ACKs come with the first chunk ([Note: pull with the clock]).
                pending = posted.granted(wait_acks=False)
            self.fetcher.start(pending.wait_chunk)
            self.fresh = clock
            self.pending_pull = pending
            self.last_metrics = {"ps_wait_s": time.perf_counter() - t0}
            return
        with self.tracer.span("pull", cat="communication", step=clock):
            flats: list[torch.Tensor] = []
            staleness = 0
            if self.is_pusher:
                assert self.client is not None
                # the pull posted with the last CLOCK, if any, else a new one; every chunk
                posted = self._posted_pull(clock) or self.client.post_pull(clock)
                granted = posted.granted()
                granted.wait_rest()
                flats, floors = granted.flats, granted.floors
                staleness = max(clock - f for f in floors)
            if self.host_group is not None:
                whole = torch.cat(flats) if flats else self._empty_whole()
                ps_wire.broadcast(whole, self.leader, self.host_group)
                flats = list(whole.split([self.layout.numel(s) for s in range(len(self.servers))]))
            params = self._params()
            with torch.no_grad():
                for s, flat in enumerate(flats):
                    for name, view in self.layout.unflatten(flat, s).items():
                        params[name].copy_(view)
        self.fresh = clock
        self.last_metrics = {
            "ps_staleness": float(staleness),
            "ps_wait_s": time.perf_counter() - t0,
        }

    def _posted_pull(self, clock: int) -> PostedPull | None:
        """The pull of ``clock`` posted with the last CLOCK, if any (taken)."""
        posted, self.next_pull = self.next_pull, None
        assert posted is None or posted.clock == clock, (posted and posted.clock, clock)
        return posted

    def _post_clock(self, step: int, loss: torch.Tensor) -> None:
        """End the push of ``step`` before the loss all-reduce: a NaN push if this worker's
        own loss or gradient is non-finite, then the CLOCK ([Note: pull with the clock] in
        polytrain.ps.overlap); `_push` posts the next pull and waits for the sends."""
        assert self.client is not None and self.pusher is not None
        with self.tracer.span("push-clock", cat="communication", step=step):
            if not self.pusher.finite(loss):  # [Note: parameter-server NaN]
                self.client.wait_chunks()
                self.pusher.repost(functools.partial(self.client.post_chunk, step), math.nan)
            self.client.post_clock(step)

    def _empty_whole(self) -> torch.Tensor:
        total = sum(self.layout.numel(s) for s in range(len(self.servers)))
        return torch.empty(total, dtype=self.layout.dtype)

    def _forward_backward(self, step: int) -> torch.Tensor:
        """This worker's mean loss of step ``step``; leaves its gradient in the replica."""
        accum = self.job.train.grad_accum
        train_mode(self.model)
        self.model.zero_grad(set_to_none=True)
        total = forward_backward(
            self.model,
            self.model.loss,
            lambda micro: self.batches.train(step, self.rank, self.num_workers, micro, accum),
            step=step,
            num_microbatches=accum,
            device=torch.device("cpu"),
            dtype=self.job.train.dtype,
            tracer=self.tracer,
            around=functools.partial(self._arm_pushes, step),
        )
        if self.fetcher is not None and self.pusher is not None:
            if self.fetcher.pending:  # this step pulled (not evaluate before it)
                self.fetcher.finish()  # parameters forward did not reach
                self.last_metrics["ps_wait_s"] += self.fetcher.wait_s
                assert self.pending_pull is not None
                floors = self.pending_pull.floors
                self.last_metrics["ps_staleness"] = float(max(step - f for f in floors))
                self.pending_pull = None
            self.pusher.flush()  # chunks of parameters without a gradient
            self.last_metrics["ps_early_chunks"] = self.pusher.early / max(
                1, len(self.pusher.order)
            )
        return total

    @contextlib.contextmanager
    def _arm_pushes(self, step: int, last: bool) -> Iterator[None]:
        """Overlapped pushes: the last micro-batch's backward posts each gradient chunk once
        it is final ([Note: prioritised overlap] in `ps.overlap`)."""
        if self.pusher is not None and last:
            assert self.client is not None
            self.pusher.arm(functools.partial(self.client.post_chunk, step))
        yield

    def _push(self, step: int, poison: bool = False) -> None:
        """Push this replica's gradient of ``step``; ``poison``: a NaN one instead (a dropped
        step the servers must see, [Note: parameter-server NaN])."""
        with self.tracer.span("push", cat="communication", step=step):
            if self.pusher is not None:  # chunks and CLOCK are posted (`_post_clock`)
                assert self.client is not None
                self._post_next_pull(step, poison)
                self.client.wait_chunks()
            else:
                grads = {
                    n: (p.grad if p.grad is not None else torch.zeros_like(p))
                    for n, p in self._params().items()
                }
                flats = [self.layout.flatten(grads, s) for s in range(len(self.servers))]
                if poison:
                    flats = [torch.full_like(f, math.nan) for f in flats]
                self._send(step, flats)
                if not self.sync and self.is_pusher:  # [Note: pull with the clock], async/ssp
                    self._post_next_pull(step, poison)
            if poison and self.colocated is not None:
                self.colocated.wait_handled(step)  # see ColocatedServer.wait_handled

    def _post_next_pull(self, step: int, poison: bool) -> None:
        """Post the next step's pull with this push ([Note: pull with the clock]), unless this
        is the last step or a stop is coming."""
        stopping = poison and self.rules.on_nonfinite == "stop"
        if step + 1 < self.job.train.steps and not stopping:
            assert self.client is not None
            self.next_pull = self.client.post_pull(step + 1)

    def _send(self, step: int, flats: list[torch.Tensor]) -> None:
        if self.host_group is not None:
            whole = torch.cat(flats)
            ps_wire.all_reduce_sum(whole, self.host_group)
            flats = list(whole.split([f.numel() for f in flats]))
        if self.is_pusher:
            assert self.client is not None
            scaled = [f * self.push_scale for f in flats] if self.push_scale != 1 else flats
            self.client.push(step, scaled)

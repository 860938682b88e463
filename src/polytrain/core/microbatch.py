"""One step's micro-batches: forward, backward and gradient accumulation (``train.grad_accum``).

Written once for every family whose rank runs a whole replica (SPMD, gossip replicas,
parameter-server workers). What differs between them is passed in: how a micro-batch is fetched,
the backward (fp16's scaled loss), and what surrounds a micro-batch knowing whether it is the
last (DDP's ``no_sync`` until then; a parameter-server worker's push hooks armed for it).
Pipeline stages interpret their schedule instead and do not use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from polytrain.core.step import autocast
from polytrain.models.base import Inputs, inputs_to, to_device
from polytrain.observe.trace import Tracer

__all__ = ["forward_backward"]


def _plain_backward(loss: torch.Tensor) -> None:
    loss.backward()


def _nothing(last: bool) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def forward_backward(
    model: Callable[[Inputs], Any],
    loss: Callable[[Any, torch.Tensor], torch.Tensor],
    batch: Callable[[int], tuple[Inputs, torch.Tensor]],
    *,
    step: int,
    num_microbatches: int,
    device: torch.device,
    dtype: str,
    tracer: Tracer,
    backward: Callable[[torch.Tensor], None] = _plain_backward,
    around: Callable[[bool], contextlib.AbstractContextManager[None]] = _nothing,
) -> torch.Tensor:
    """Run ``num_microbatches`` forwards and backwards; return the step's mean loss (detached,
    on ``device``, not read on the host). Gradients accumulate in the parameters.

    ``batch(microbatch_index)`` gives a micro-batch's inputs and targets (moved to ``device``
    here); each loss is divided by ``num_microbatches`` before its backward, so the accumulated
    gradient is the mean's. ``around(last)`` wraps a micro-batch's forward and backward.
    """
    total = torch.zeros((), device=device)
    for micro in range(num_microbatches):
        x, y = batch(micro)
        x, y = inputs_to(x, device), to_device(y, device)
        with around(micro == num_microbatches - 1):
            with tracer.span("forward", microbatch=micro, step=step):
                with autocast(device, dtype):
                    value = loss(model(x), y) / num_microbatches
            with tracer.span("backward", microbatch=micro, step=step):
                backward(value)
        total += value.detach()
    return total

"""What a block keeps, and what it runs again, under selective recomputation (torch-facing).

[Note: selective recomputation's statistics] ``parallel.recompute = "ops"`` checkpoints every
block with torch's selective checkpoint under `core.recompute.ops_policy` ([Note: selective
recomputation]): past the forward a block holds its input (the checkpoint keeps its arguments)
and the outputs of the operators the policy saves (matmuls, fused attention); in backward it
runs the other operators again, and while it does, the tensors autograd saves that are not
among the kept ones exist once more (one block at a time). `count_ops` runs the block's
forward once under a dispatch mode that asks that same policy function about every operator
and counts, per sample:

* ``ops_kept_bytes``: the distinct storages of the input and of the saved operators' outputs
  (and, on the last block, what the loss outside the checkpoint saves);
* ``ops_rebuilt_bytes``: what autograd saves during the forward that is not kept (what a
  backward's recomputation rebuilds);
* ``ops_rerun_*``: the other operators as `OpCounter` counts a forward (calls, bytes moved,
  heavy elementwise ones) and their FLOPs by torch's FLOP formulas (convolutions; a
  transformer's matmuls are all kept, so it reruns next to none).

Attention is counted as the kernel keeps it, as `AttentionCounter` does for the saved bytes
([Note: fused attention's saved tensors] in measure/kernels.py): on a CPU or CUDA device the
fused operator is one of the policy's saved ones; the meta device's math path (whose score
``bmm`` the policy would keep, T x S per head) is hidden and the call counted as the fused
kernel's output and its fp32 log-sum-exp.

A user's model's layer view runs a whole `LayerStage` here, its embeddings and head included,
where the runtime checkpoints the repeated layers only: the first and last layers' figures
count those parts as recomputed too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.flop_counter import flop_registry

from polytrain._torch_private import storage_key
from polytrain.core.recompute import ops_policy
from polytrain.measure.kernels import OpCounter
from polytrain.measure.meta_autocast import MetaAutocast
from polytrain.measure.tp_stats import tensors_in
from polytrain.pipeline.saved_tensors import SavedBytes

__all__ = ["OpsCounter", "count_ops"]

_SAVE = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


class OpsCounter(OpCounter):
    """Sorts a forward's operators by `core.recompute.ops_policy`: the saved ones' outputs
    into ``kept``, the others counted as `OpCounter` counts them (the rerun) with their FLOPs
    in ``rerun_flops``; ``rebuilt``: what autograd saves that is not kept (`saving`)."""

    def __init__(self, exclude: set[int]) -> None:
        super().__init__()
        self.kept = SavedBytes(exclude, keep=True)
        self.rebuilt = SavedBytes(exclude, keep=True)
        self.rerun_flops = 0.0
        self.hidden = 0  # inside a meta attention call: its math path is not what runs
        self._kept_keys: set[int] = set()

    def keep(self, tensor: torch.Tensor) -> None:
        self._kept_keys.add(storage_key(tensor))
        self.kept.add(tensor)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.hidden:
            return func(*args, **kwargs)
        if ops_policy(None, func, *args, **kwargs) in _SAVE:
            out = func(*args, **kwargs)
            for tensor in tensors_in(out):
                self.keep(tensor)
            return out
        out = super().__torch_dispatch__(func, types, args, kwargs)
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            self.rerun_flops += float(formula(*args, **kwargs, out_val=out))
        return out

    @contextmanager
    def saving(self, kept: bool = False) -> Iterator[None]:
        """Autograd's saves under it: counted as rebuilt unless kept (``kept``: all kept, the
        loss outside the checkpoint)."""

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if kept:
                self.keep(tensor)
            elif storage_key(tensor) not in self._kept_keys:
                self.rebuilt.add(tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, _same):
            yield

    def release(self) -> None:
        self.kept.release()
        self.rebuilt.release()


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _MetaAttention(TorchFunctionMode):
    """A meta ``F.scaled_dot_product_attention`` call counted as a fused kernel keeps it: its
    output and a (batch, heads, T) fp32 log-sum-exp kept, its math path hidden."""

    def __init__(self, counter: OpsCounter) -> None:
        super().__init__()
        self.counter = counter
        self._lse: list[torch.Tensor] = []  # alive while counting: a freed identity is reused

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        q = args[0] if args else kwargs.get("query")
        if func is not F.scaled_dot_product_attention or q.device.type != "meta":
            return func(*args, **kwargs)
        self.counter.hidden += 1
        try:
            with torch.autograd.graph.saved_tensors_hooks(_same, _same):  # the math path's saves
                out = func(*args, **kwargs)
        finally:
            self.counter.hidden -= 1
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        self._lse.append(lse)
        self.counter.keep(out)
        self.counter.keep(lse)
        return out


def _call(block: nn.Module, h: Any) -> Any:
    return block(**h) if isinstance(h, dict) else block(h)


def count_ops(
    block: nn.Module,
    h: Any,
    exclude: set[int],
    batch: int,
    loss: Any = None,
    low_precision: torch.dtype | None = None,
) -> dict[str, Any]:
    """`BlockStats`' ``ops_*`` fields of ``block`` on input ``h`` (``batch`` samples), per
    sample ([Note: selective recomputation's statistics]); ``loss``: the last block's loss
    function of its output, run outside the checkpoint as the trainer runs it. A block without
    parameters is not checkpointed (`core.recompute.apply_recompute`): none (it keeps what it
    saves, as a `BlockStats` without them is priced)."""
    if not any(True for _ in block.parameters()):
        return {}  # not checkpointed: keeps what it saves, as `BlockStats` without these fields
    counter = OpsCounter(exclude)
    for tensor in tensors_in(h):
        counter.keep(tensor)  # the checkpoint holds its arguments
    cast = MetaAutocast(low_precision) if low_precision is not None else nullcontext()
    try:
        with counter.saving(), counter, _MetaAttention(counter), cast:
            y = _call(block, h)
        if loss is not None:
            with counter.saving(kept=True), cast:
                loss(y)
        return {
            "ops_kept_bytes": counter.kept.bytes / batch,
            "ops_rebuilt_bytes": counter.rebuilt.bytes / batch,
            "ops_rerun_flops": counter.rerun_flops / batch,
            "ops_rerun_ops": counter.ops,
            "ops_rerun_moved_bytes": counter.moved / batch,
            "ops_rerun_elementwise": counter.per_sample(batch),
        }
    finally:
        counter.release()

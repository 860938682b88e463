"""The kernels of a CPU block the FLOP count misprices, counted in the model and timed on this
host (torch-facing): attention, Linears on operands out of cache, heavy elementwise operators.

[Note: attention kernels] On a CPU host ``F.scaled_dot_product_attention`` runs one fused
kernel (``_scaled_dot_product_flash_attention_for_cpu`` and its backward) that torch's
`FlopCounterMode` does not count (no formula for it: gpt tiny's forward counted only its
Linears' 0.805 GFLOP per 32 sequences) and `OpCounter` leaves out of the bytes moved (it is a
matmul), so the flops-based cost model priced a block's attention at nothing; on the meta device
the same call decomposes into bmm's and a softmax that were priced at the Linears' rate. Timed
inside a gpt tiny block (32 x 64 tokens, 4 heads of 32, one thread): the fused kernel took 1.8
ms forward and 3.8 ms backward of the block's ~42 ms, ~36 GFLOP/s against the Linears' ~80.
`AttentionCounter` records every call at the Python level (so the same on every device) as
(T, S, D, forward FLOPs per sample), the FLOPs by the usual count 4 H T S D (QK^T and PV, the
causal mask not halved), and which of the block's FLOPs `FlopCounterMode` already counted
inside it (meta: the math path's bmm's; CPU: none). `attention_rates` times the fused kernel
forward and backward, causal, on a grid of sequence lengths T and head sizes D (4 x 4 heads;
the default plan: T and D in 32 and 128; the kernel's rate grows with both, 36 -> 70 GFLOP/s
forward from (32, 32) to (128, 128) here), counting FLOPs the same way (backward: twice the
forward's). The cost model prices each recorded call at the rate of its (T, D), bilinear in
log-log over the grid (`Env._attention`, `grid_rate` in planner/cost/common.py).

[Note: cold operands] `polytrain calibrate`'s square matmuls multiply the same two matrices
call after call, which then sit in the core's cache; in a training step every matmul reads an
activation the previous operators just wrote and a weight last touched one block earlier. On
this host (2 MiB L2) a (2048 x 128) @ (128 x 128) matmul ran at 99 GFLOP/s on the same operands
and 84 on operands taken in turn from a pool larger than the cache; the Linears inside a gpt
tiny block ran at ~80. `gemm_rates` times a Linear's forward, ``(rows x s) @ (s x s)^T`` plus a
bias, for each weight size ``s``, with both operands rotated through a 64 MiB pool, so none
is in cache when it is used.

[Note: elementwise kernels] `OpCounter` prices a non-matmul operator by the bytes it reads and
writes at the copy bandwidth; one thread computes a GELU (erf) far slower than it moves the
bytes: 2.2 G elements/s here against 10 for an add, and inside a gpt tiny block GELU and its
backward took ~1 + ~2.9 ms against ~0.2 + ~0.5 priced. `ELEMENTWISE` names the operators
whose arithmetic per element is heavy (transcendentals, softmax); `OpCounter` records each
one's output elements and bytes, and `elementwise_seconds` times each on 2^20 fp32 elements
(1024 x 1024, larger than a core's L2: its bytes come from memory as in a step) for seconds
per element, which the cost model charges instead of its bytes' time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from polytrain._torch_private import TorchDispatchMode
from polytrain.measure.timing import Rounds
from polytrain.pipeline.saved_tensors import SavedBytes

__all__ = [
    "ELEMENTWISE",
    "AttentionCounter",
    "OpCounter",
    "attention_rates",
    "elementwise_seconds",
    "gemm_rates",
    "kernel_rates",
]


class Operators(Protocol):
    """What `AttentionCounter` resets of an `OpCounter`."""

    ops: int
    moved: float
    elementwise: dict[str, list[float]]


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class AttentionCounter(TorchFunctionMode):
    """[Note: attention kernels] Records each ``F.scaled_dot_product_attention`` call under it:
    ``calls`` holds (T, S, D, forward FLOPs) of the whole call (all samples and heads), and
    ``counted`` the FLOPs ``flops`` (the block's `FlopCounterMode`, if any) counted inside it.
    ``ops`` (the block's forward `OpCounter`, if any) counts each call as the one fused
    operator it is on a CPU host whatever the device: the meta device's math path (scale, mask,
    softmax, views) would add operator calls and bytes the attention rate already includes.

    [Note: fused attention's saved tensors] What a call keeps for backward is counted as the
    kernel the job runs keeps it. On a CPU or CUDA device that is what autograd saves there
    (``saved``'s hooks see the real kernel: CPU's flash kernel, CUDA's flash, memory-efficient
    or cuDNN kernel, or the math path where torch falls back to it). The meta device always
    takes the math path, which saves the (T x S) scores and their softmax per head, where every
    fused kernel (Dao et al. 2022, FlashAttention, sec. 3.1; torch's flash and memory-efficient
    backward formulas) keeps its inputs q, k, v (and a mask), its output and one fp32
    log-sum-exp per query row: O(T), not O(T^2). With ``saved`` (the block's `SavedBytes`), a
    call on meta is counted that way: its own saves are hidden from the block's hooks and q, k,
    v, the mask, the output and a (batch, heads, T) fp32 log-sum-exp are counted once each.
    A Llama-3-8B-shaped transformers layer at T = 8192 (fp32) saved 11.0 GiB per sample on
    meta's math path, 2.7 GiB with this rule."""

    def __init__(
        self,
        flops: FlopCounterMode | None = None,
        ops: Operators | None = None,
        saved: SavedBytes | None = None,
    ) -> None:
        super().__init__()
        self.flops = flops
        self.ops = ops
        self.saved = saved
        self.calls: list[tuple[int, int, int, float]] = []
        self.counted = 0.0
        # the log-sum-exps counted on meta, kept alive: a freed storage's identity is reused
        self._lse: list[torch.Tensor] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        before = self.flops.get_total_flops() if self.flops is not None else 0
        kept = None
        if self.ops is not None:
            elementwise = {op: list(pair) for op, pair in self.ops.elementwise.items()}
            kept = (self.ops.ops, self.ops.moved, elementwise)
        q, k, v = args[0], args[1], args[2]
        fused = (
            self.saved is not None
            and q.device.type == "meta"
            and torch.is_grad_enabled()
            and any(t.requires_grad for t in (q, k, v))
        )
        if fused:
            with torch.autograd.graph.saved_tensors_hooks(_kept, _kept):  # hide the math path's
                out = func(*args, **kwargs)
            self._count_fused(q, k, v, args[3] if len(args) > 3 else kwargs.get("attn_mask"), out)
        else:
            out = func(*args, **kwargs)
        after = self.flops.get_total_flops() if self.flops is not None else 0
        if self.ops is not None and kept is not None:
            self.ops.ops, self.ops.moved, self.ops.elementwise = kept[0] + 1, kept[1], kept[2]
        t, d, s = q.shape[-2], q.shape[-1], k.shape[-2]
        heads = math.prod(q.shape[:-2])  # batch x heads
        self.calls.append((int(t), int(s), int(d), 4.0 * heads * t * s * d))
        self.counted += float(after - before)
        return out

    def _count_fused(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        """[Note: fused attention's saved tensors]: what a fused kernel keeps of one call."""
        assert self.saved is not None
        for tensor in (q, k, v, mask, out):
            if isinstance(tensor, torch.Tensor):
                self.saved.add(tensor)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)  # (B, H, T)
        self.saved.add(lse, split=self.saved.is_split(q))
        self._lse.append(lse)


def gemm_rates(
    sizes: tuple[int, ...], budget_s: float, rows: int = 4096, pool_bytes: int = 64 * 2**20
) -> dict[int, tuple[float, float]]:
    """[Note: cold operands] (FLOP/s, spread) of a fp32 Linear's forward ``addmm`` of ``rows``
    rows by an (s x s) weight, per ``s``, its operands rotated through ``pool_bytes`` of
    memory; the sizes interleaved in rounds ([Note: timing rounds])."""
    pool = torch.rand(pool_bytes // 4)
    fns: dict[int, Callable[[], object]] = {}
    for s in sizes:
        per = rows * s + s * s
        count = max(pool.numel() // per, 1)
        pairs = [
            (
                pool[i * per : i * per + rows * s].view(rows, s),
                pool[i * per + rows * s : (i + 1) * per].view(s, s),
            )
            for i in range(count)
        ]
        bias = torch.zeros(s)
        state = {"i": 0}

        def call(
            pairs: list[tuple[torch.Tensor, torch.Tensor]] = pairs,
            bias: torch.Tensor = bias,
            state: dict[str, int] = state,
        ) -> object:
            state["i"] = (state["i"] + 1) % len(pairs)
            x, w = pairs[state["i"]]
            return torch.addmm(bias, x, w.t())

        fns[s] = call
    result = Rounds(fns, torch.device("cpu"), budget_s).result()
    return {s: (2.0 * rows * s * s / secs, spread) for s, (secs, spread) in result.items()}


ATTENTION_HEADS = (4, 4)  # the probe's (batch, heads)


def attention_rates(
    lengths: tuple[int, ...], head_dims: tuple[int, ...], budget_s: float
) -> dict[tuple[int, int], tuple[float, float, float]]:
    """[Note: attention kernels] (forward FLOP/s, backward FLOP/s, spread) of causal fp32
    ``scaled_dot_product_attention`` on this host's default kernel per (sequence length T, head
    size D), FLOPs counted as `AttentionCounter` counts them (backward: twice the forward's)."""
    fns: dict[tuple[str, int, int], Callable[[], object]] = {}
    for t in lengths:
        for d in head_dims:
            q, k, v = (torch.randn(*ATTENTION_HEADS, t, d, requires_grad=True) for _ in range(3))
            fns[("fwd", t, d)] = partial(
                F.scaled_dot_product_attention, q.detach(), k.detach(), v.detach(), is_causal=True
            )
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            fns[("bwd", t, d)] = partial(
                torch.autograd.grad, out, (q, k, v), torch.ones_like(out), retain_graph=True
            )
    result = Rounds(fns, torch.device("cpu"), budget_s).result()
    heads = math.prod(ATTENTION_HEADS)
    rates: dict[tuple[int, int], tuple[float, float, float]] = {}
    for t in lengths:
        for d in head_dims:
            flops = 4.0 * heads * t * t * d
            (fwd, s_fwd), (bwd, s_bwd) = result[("fwd", t, d)], result[("bwd", t, d)]
            rates[(t, d)] = (flops / fwd, 2.0 * flops / bwd, max(s_fwd, s_bwd))
    return rates


def kernel_rates(
    gemm_sizes: tuple[int, ...],
    lengths: tuple[int, ...],
    head_dims: tuple[int, ...],
    budget_s: float,
    spread: dict[str, float],
) -> tuple[dict[int, float], dict[tuple[int, int], tuple[float, float]], dict[str, float]]:
    """`polytrain calibrate`'s CPU kernel figures: (`HostProfile.gemm_by_size`,
    `HostProfile.attention_rates`, `HostProfile.elementwise_s`), the first two empty when their
    sizes are; their spreads go into ``spread`` ([Note: timing rounds])."""
    gemm: dict[int, float] = {}
    attention: dict[tuple[int, int], tuple[float, float]] = {}
    if gemm_sizes:
        for n, (rate, spread[f"gemm fp32 {n}"]) in gemm_rates(gemm_sizes, budget_s).items():
            gemm[n] = rate
    if lengths and head_dims:
        for (t, d), (fwd, bwd, spread[f"attention T{t} D{d}"]) in attention_rates(
            lengths, head_dims, budget_s
        ).items():
            attention[(t, d)] = (fwd, bwd)
    elementwise: dict[str, float] = {}
    for op, (secs, spread[op]) in elementwise_seconds(budget_s).items():
        elementwise[op] = secs
    return gemm, attention, elementwise


# [Note: kernels in a fresh process]
# `calibrate` measures the kernels on a rank of its own (`rank_kernel_rates`), as a training
# worker runs them: a fresh process. Measured in the calibrating process itself, after its
# matmul rounds, the 256 MiB copy and the end-of-step probes, attention read 25-30% below what
# the same `kernel_rates` read in a fresh process just before and after on the 2-core VM
# (2026-11-26 21:52: T128 D128 forward 71 GFLOP/s against 97 and 86, backward 54 against 77 and
# 66; the two saved profiles of that evening 69 and 76), and gpt tiny's one-process step was
# priced 32-41% high in every benchmark run that day while its blocks timed in a fresh process
# came within 7% of the step.


def rank_kernel_rates(
    rank: int,
    world: int,
    threads: int,
    gemm_sizes: tuple[int, ...],
    lengths: tuple[int, ...],
    head_dims: tuple[int, ...],
    budget_s: float,
) -> tuple[
    dict[int, float], dict[tuple[int, int], tuple[float, float]], dict[str, float], dict[str, float]
]:
    """[Note: kernels in a fresh process] `kernel_rates` with ``threads`` intra-op threads on a
    rank of its own; its spreads are the fourth item."""
    torch.set_num_threads(threads)
    spread: dict[str, float] = {}
    gemm, attention, elementwise = kernel_rates(gemm_sizes, lengths, head_dims, budget_s, spread)
    return gemm, attention, elementwise, spread


def _elementwise_probes(x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """One call of each `ELEMENTWISE` operator on ``x`` (rows of a softmax: its last dim). The
    softmax family's operators have private names: they are reached through the public
    functions that dispatch them (their backward through autograd, one node)."""
    aten = torch.ops.aten
    g, y = torch.ones_like(x), torch.softmax(x, -1)
    leaf = x.detach().requires_grad_(True)
    soft, logsoft = torch.softmax(leaf, -1), torch.log_softmax(leaf, -1)
    return {
        "aten.gelu": partial(aten.gelu, x),
        "aten.gelu_backward": partial(aten.gelu_backward, g, x),
        "aten.silu": partial(aten.silu, x),
        "aten.silu_backward": partial(aten.silu_backward, g, x),
        "aten.tanh": partial(aten.tanh, x),
        "aten.tanh_backward": partial(aten.tanh_backward, g, y),
        "aten.sigmoid": partial(aten.sigmoid, x),
        "aten.exp": partial(aten.exp, x),
        "aten._softmax": partial(torch.softmax, x, -1),
        "aten._softmax_backward_data": partial(
            torch.autograd.grad, soft, leaf, g, retain_graph=True
        ),
        "aten._log_softmax": partial(torch.log_softmax, x, -1),
        "aten._log_softmax_backward_data": partial(
            torch.autograd.grad, logsoft, leaf, g, retain_graph=True
        ),
    }


ELEMENTWISE = frozenset(_elementwise_probes(torch.ones(1, 1)))


_MATMULS = {
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.baddbmm",
    "aten.convolution",
    "aten.convolution_backward",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_efficient_attention_backward",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_flash_attention_backward",
}


class OpCounter(TorchDispatchMode):
    """[Note: non-matmul time] Counts every ATen operator call under it and the bytes the
    non-matmul, non-view ones read and write (tensor inputs + outputs). The cost model prices
    matmuls by FLOPs at the calibrated matmul rate; the rest of a block's time is operators that
    move memory (layer norms, activations, softmax, the loss) and the per-call dispatch overhead
    of every operator, which dominates on small models."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.moved = 0.0
        # [Note: elementwise kernels] in measure/kernels.py: op -> [output elements, bytes]
        self.elementwise: dict[str, list[float]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        name = str(func.overloadpacket)
        if name not in _MATMULS and not func.is_view:
            outs = out if isinstance(out, tuple | list) else (out,)
            tensors = [
                t for t in (*args, *(kwargs or {}).values(), *outs) if isinstance(t, torch.Tensor)
            ]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            self.moved += nbytes
            if name in ELEMENTWISE and isinstance(outs[0], torch.Tensor):
                entry = self.elementwise.setdefault(name, [0.0, 0.0])
                entry[0] += outs[0].numel()
                entry[1] += nbytes
        return out

    def per_sample(self, batch: int) -> tuple[tuple[str, float, float], ...]:
        """`elementwise` as (op, output elements, bytes) per sample."""
        return tuple((op, n / batch, b / batch) for op, (n, b) in sorted(self.elementwise.items()))


def elementwise_seconds(budget_s: float, side: int = 1024) -> dict[str, tuple[float, float]]:
    """[Note: elementwise kernels] (seconds per output element, spread) of each `ELEMENTWISE`
    operator on a ``side`` x ``side`` fp32 tensor, interleaved in rounds."""
    x = torch.randn(side, side)
    result = Rounds(_elementwise_probes(x), torch.device("cpu"), budget_s).result()
    return {op: (secs / x.numel(), spread) for op, (secs, spread) in result.items()}

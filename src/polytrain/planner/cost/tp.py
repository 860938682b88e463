"""Tensor parallel (Megatron-LM): per-layer collectives of activations, on the critical path.

Shoeybi et al., "Megatron-LM", 2019, sec. 3: a transformer layer split column- then row-wise
needs one all-reduce (``g``) after the attention and one after the MLP in forward, and their
conjugates (``f``) in backward. They sit between dependent matmuls, so nothing hides them.
Derivation: docs/planner.md "Tensor parallel".

[Note: tensor-parallel modules] With the plan's modules known (`BlockStats.tp_modules`, from
the runtime's own plan, `measure.tp_stats`), the collectives are counted per module as torch's
DTensor styles issue them, each of its own activation:

* ``colwise`` / ``qkv`` (``ColwiseParallel``: input Replicate, output Shard(-1)): nothing in
  forward; in backward its input's gradient is Partial and is all-reduced (Megatron's ``f``).
  Each module does so apart: gpt's separate q, k and v projections all-reduce three times
  where Megatron's fused qkv does once (measured: 16 backward all-reduces in gpt tiny tp2,
  four layers x (q, k, v, fc));
* ``colwise_gather`` (output Replicate): an all-gather of its output in forward, the input
  gradient's all-reduce in backward;
* ``rowwise`` (input Shard(-1)): an all-reduce of its output in forward (``g``), nothing in
  backward; ``rowwise_split`` (input Replicate, sliced locally): the same forward, an
  all-gather of its input's gradient in backward;
* ``vocab`` (an embedding split by rows; ids replicated): an all-reduce of its output in
  forward, nothing in backward (ids take no gradient).

A module whose divisor the degree does not divide is not parallelized (the plan's vocabulary
rows), and costs nothing. On a calibrated CPU host a group of two pays each collective's price
inside a step ([Note: tensor-parallel collectives in a step] in measure/probes.py). Each
module also pays DTensor's dispatch, calibrated per module ([Note: DTensor module overhead]
in measure/probes.py), half in each pass. Without the
modules (a model without a plan, `stats_pure`): the old count, two all-reduces of the
block's output per pass (one at the ends: embedding, head).
"""

from __future__ import annotations

from polytrain.planner.cost.common import Env
from polytrain.planner.types import BlockStats, TPModule

__all__ = [
    "collectives_per_pass",
    "module_collectives",
    "tp_collectives",
    "tp_comm_s",
    "tp_dispatch_s",
]

# style -> ((forward op, on its "in" or "out" bytes) ..., ), ((backward ...), ...)
_COLLECTIVES: dict[str, tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]] = {
    "colwise": ((), (("all_reduce", "in"),)),
    "qkv": ((), (("all_reduce", "in"),)),
    "colwise_gather": ((("all_gather", "out"),), (("all_reduce", "in"),)),
    "rowwise": ((("all_reduce", "out"),), ()),
    "rowwise_split": ((("all_reduce", "out"),), (("all_gather", "in"),)),
    "vocab": ((("all_reduce", "out"),), ()),
}


def module_collectives(module: TPModule, backward: bool) -> list[tuple[str, float]]:
    """(operation, bytes per sample) of one pass of ``module`` ([Note: tensor-parallel
    modules]); an input that takes no gradient (token ids, 0 bytes) reduces nothing."""
    fwd, bwd = _COLLECTIVES.get(module.style, ((), ()))
    out = []
    for op, side in bwd if backward else fwd:
        nbytes = module.in_bytes if side == "in" else module.out_bytes
        if nbytes > 0:
            out.append((op, nbytes))
    return out


def collectives_per_pass(block: BlockStats, first: bool, last: bool) -> int:
    """All-reduces in the forward (and as many in the backward) of one block, without its
    plan's modules (the old count)."""
    return 1 if (first or last) else 2


def tp_comm_s(
    env: Env,
    block: BlockStats,
    samples: float,
    tp: int,
    *,
    first: bool,
    last: bool,
    backward: bool = False,
) -> float:
    """Seconds of one pass's (``backward`` or forward) tensor-parallel collectives for
    ``block``."""
    if tp <= 1:
        return 0.0
    if block.tp_modules is not None:
        return sum(
            env.tp_collective_s(op, nbytes * samples, tp)
            for module in block.tp_applied(tp)
            for op, nbytes in module_collectives(module, backward)
        )
    n = collectives_per_pass(block, first, last)
    nbytes = block.output_bytes * samples
    if last:  # the head's collective moves the (small) input, not the vocabulary-wide logits
        nbytes = _input_bytes(block) * samples
    return n * env.tp_collective_s("all_reduce", nbytes, tp)


def tp_collectives(
    block: BlockStats, tp: int, *, first: bool, last: bool, backward: bool = False
) -> int:
    """How many collectives one pass (``backward`` or forward) of ``block`` makes over ``tp``
    ranks, counted as `tp_comm_s` prices them."""
    if tp <= 1:
        return 0
    if block.tp_modules is not None:
        return sum(len(module_collectives(m, backward)) for m in block.tp_applied(tp))
    return collectives_per_pass(block, first, last)


def tp_dispatch_s(env: Env, block: BlockStats, tp: int) -> float:
    """DTensor's dispatch over the block's parallelized modules in one forward + backward
    ([Note: DTensor module overhead] in measure/probes.py), slowed by shared cores; 0 without
    the modules or a profile that measured it."""
    per_module = env.profile.tp_module_s if env.profile is not None else 0.0
    return per_module * len(block.tp_applied(tp)) * env.cpu_slowdown


def _input_bytes(block: BlockStats) -> float:
    if block.linears:
        fan_in, fan_out = block.linears[-1]
        return block.output_bytes * fan_in / fan_out
    return block.output_bytes

"""Tensor parallel (Megatron-LM): per-layer all-reduces of activations, on the critical path.

Shoeybi et al., "Megatron-LM", 2019, sec. 3: a transformer layer split column- then row-wise
needs one all-reduce (``g``) after the attention and one after the MLP in forward, and their
conjugates (``f``) in backward: 2 + 2 all-reduces of the layer's output (B x T x C) per
micro-batch. They sit between dependent matmuls, so nothing hides them. The embedding
(vocab-parallel) and the head each add one forward and one backward all-reduce.
Derivation: docs/planner.md "Tensor parallel".
"""

from __future__ import annotations

from polytrain.planner.cost.common import Env
from polytrain.planner.types import BlockStats

__all__ = ["collectives_per_pass", "tp_comm_s"]


def collectives_per_pass(block: BlockStats, first: bool, last: bool) -> int:
    """All-reduces in the forward (and as many in the backward) of one block."""
    return 1 if (first or last) else 2


def tp_comm_s(
    env: Env, block: BlockStats, samples: float, tp: int, *, first: bool, last: bool
) -> float:
    """Seconds of one pass's (forward or backward) tensor-parallel collectives for ``block``."""
    if tp <= 1:
        return 0.0
    n = collectives_per_pass(block, first, last)
    nbytes = block.output_bytes * samples
    if last:  # the head's collective moves the (small) input, not the vocabulary-wide logits
        nbytes = _input_bytes(block) * samples
    return n * env.collective_s("all_reduce", nbytes, tp, 1)


def _input_bytes(block: BlockStats) -> float:
    if block.linears:
        fan_in, fan_out = block.linears[-1]
        return block.output_bytes * fan_in / fan_out
    return block.output_bytes

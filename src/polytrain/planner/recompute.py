"""What selective recomputation (``parallel.recompute = "ops"``) costs a block: memory and time.

[Note: pricing selective recomputation] A block recomputed op by op keeps its input and the
outputs of its matmuls and attention kernels past its forward (``ops_kept_bytes``, counted by
measure/ops_stats.py under the runtime's own policy), where full recomputation keeps its input
alone and none keeps all it saves; in backward it rebuilds the rest of what autograd saves
(``ops_rebuilt_bytes``, one block at a time, as full recomputation rebuilds one block's saves)
and reruns the operators it did not keep: a forward pass of the block reduced to those
operators' FLOPs, calls and bytes (`rerun_block`, priced by `Env.fwd_s` like any forward:
`cost.parts.rerun_s`).
Tensor parallel splits the kept and rebuilt bytes as it splits the block's saved bytes
(`BlockStats.saved_per_tp_rank`). A block without the statistics (a profile counted before
them, the pure estimates of planner/stats_pure.py, a block without parameters, which the
runtime does not checkpoint) is priced as keeping what it saves and rerunning nothing.
Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import replace

from polytrain.planner.types import BlockStats, ModelStats

__all__ = ["has_ops_stats", "ops_activations", "rerun_block"]


def has_ops_stats(stats: ModelStats) -> bool:
    """Whether ``stats`` counted selective recomputation for any block (else the search does
    not offer it: every block would be priced as not recomputing)."""
    return any(b.ops_kept_bytes is not None for b in (*stats.blocks, *stats.layer_blocks))


def _tp_share(block: BlockStats, tp: int) -> float:
    """The share of ``block``'s saved bytes one of ``tp`` tensor-parallel ranks holds."""
    if tp <= 1 or block.saved_bytes <= 0:
        return 1.0
    return block.saved_per_tp_rank(tp) / block.saved_bytes


def ops_activations(
    block: BlockStats, tp: int, samples: float, fixed: float
) -> tuple[float, float]:
    """(bytes ``block`` keeps for ``samples`` samples, bytes its backward rebuilds) on one of
    ``tp`` ranks under selective recomputation; ``fixed``: its batch-independent saves
    (autocast's weight copies, recomputed: kept only where it is not checkpointed)."""
    share = _tp_share(block, tp)
    if block.ops_kept_bytes is None:
        return block.saved_bytes * share * samples + fixed, 0.0
    kept = block.ops_kept_bytes * share * samples
    return kept, block.ops_rebuilt_bytes * share * samples + fixed


def rerun_block(block: BlockStats) -> BlockStats:
    """``block`` reduced to the forward work selective recomputation reruns in backward (its
    forward pass as `Env.fwd_s` prices it, from its counts even where the whole forward was
    timed: the timing has no part for the rerun operators alone)."""
    return replace(
        block,
        fwd_flops=block.ops_rerun_flops,
        fwd_ops=block.ops_rerun_ops,
        fwd_moved_bytes=block.ops_rerun_moved_bytes,
        fwd_elementwise=block.ops_rerun_elementwise,
        attention=(),
        attention_counted=0.0,
        fwd_s=None,
    )

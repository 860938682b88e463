"""Memory per rank: model states, activations in flight, buffers and allocator slack.

PAI's memory estimate; ZeRO's accounting (Rajbhandari et al. SC20, sec. 3: parameters,
gradients and optimizer states, each sharded by ZeRO's stage) and the activations that the
pipeline schedule keeps in flight (`pipeline.schedule.peak_activations`). Derivation:
docs/planner.md "Memory". Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from polytrain.gossip.graphs import graph_for_round
from polytrain.pipeline.schedule import peak_activation_memory, peak_activations
from polytrain.planner.recompute import ops_activations
from polytrain.planner.schedules import by_rank, compute_program, layout_compute
from polytrain.planner.types import BlockStats, HostProfile, Layout, ModelStats

__all__ = [
    "ALLOCATOR_SLACK",
    "MemoryEstimate",
    "memory_per_rank",
    "process_bytes",
    "ps_server_memory",
]

ALLOCATOR_SLACK = 0.10
"""Fraction added for the caching allocator's fragmentation and rounding. An assumption: PyTorch
documents the behaviour (``torch.cuda.memory_reserved`` >= allocated) but no fixed ratio; planner2's
benchmark measures peak against this estimate (target: within 20% on CPU)."""


@dataclass(frozen=True)
class MemoryEstimate:
    weights: float
    grads: float
    optimizer: float
    activations: float
    buffers: float

    @property
    def model_states(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return (self.model_states + self.activations + self.buffers) * (1 + ALLOCATOR_SLACK)

    def as_dict(self) -> dict[str, float]:
        return {
            "weights": self.weights,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "buffers": self.buffers,
            "total": self.total,
        }


def memory_per_rank(
    stats: ModelStats,
    layout: Layout,
    stage_blocks: Sequence[Sequence[BlockStats]],
    microbatch_samples: float,
) -> MemoryEstimate:
    """Peak bytes on the busiest rank of ``layout`` (the max over pipeline stages).

    ``stage_blocks``: the blocks of each stage (one list when pp == 1);
    ``microbatch_samples``: samples in one micro-batch (one grad-accumulation micro-step when
    pp == 1) on one replica.
    """
    if layout.pp > 1 and layout_compute(layout)[1].stages_per_rank > 1:
        return _several_stages(stats, layout, stage_blocks, microbatch_samples)
    in_flight = _in_flight(layout)
    starts = _starts(stage_blocks)
    best: MemoryEstimate | None = None
    for s, blocks in enumerate(stage_blocks):
        act, rebuilt = _activation_sizes(
            layout, _recomputed(stats, layout, blocks), microbatch_samples, starts[s]
        )
        est = _stage(
            stats, layout, blocks, microbatch_samples, act * in_flight[s] + rebuilt, in_flight[s], s
        )
        if best is None or est.total > best.total:
            best = est
    assert best is not None
    return best


def _several_stages(
    stats: ModelStats,
    layout: Layout,
    stage_blocks: Sequence[Sequence[BlockStats]],
    mb_samples: float,
) -> MemoryEstimate:
    """`memory_per_rank` where a rank holds several virtual stages (interleaved 1F1B, ZBV).

    [Note: activations of several stages per rank] A rank's activations are the peak, over its
    program, of the bytes its stages hold at once: each stage's one-micro-batch activations
    from its F to its B (or W), summed by `pipeline.schedule.peak_activation_memory` with the
    stages' own sizes (they differ: the head's logits, the embedding). Interleaved 1F1B's rank 0
    peaks at ``v p + p - 1`` chunks, ``p + (p - 1) / v`` stages' worth against 1F1B's ``p``;
    ZBV's every rank at ``2 p`` chunks, ``p`` stages' worth (`pipeline.schedule.formulas`).
    Model states are all the rank's stages'; a recomputing rank rebuilds one block at a time."""
    program, stage_map = layout_compute(layout)
    starts = _starts(stage_blocks)
    sizes = [
        _activation_sizes(layout, blocks, mb_samples, start)
        for blocks, start in zip(stage_blocks, starts, strict=True)
    ]
    peaks = peak_activation_memory(program, lambda stage: sizes[stage][0])
    chunks = peak_activations(program)  # one micro-batch of one stage each
    best: MemoryEstimate | None = None
    for rank, blocks in enumerate(by_rank(stage_blocks, stage_map)):
        rebuilt = max(sizes[s][1] for s in stage_map.stages_of(rank))
        est = _stage(stats, layout, blocks, mb_samples, peaks[rank] + rebuilt, chunks[rank], rank)
        if best is None or est.total > best.total:
            best = est
    assert best is not None
    return best


def ps_server_memory(stats: ModelStats, layout: Layout) -> MemoryEstimate:
    """One parameter server's bytes: its 1/K of the parameters, the gradient buffer pushes are
    summed into, and the optimizer state of its shard (the server runs the optimizer). The
    shards are taken equal; `ps.sharding.plan_shards` balances whole tensors, so the busiest
    server holds a little more when tensors are few and large."""
    shard = stats.param_bytes / max(layout.ps_servers, 1)
    return MemoryEstimate(shard, shard, shard * stats.optimizer_state_per_param, 0.0, 0.0)


def process_bytes(stats: ModelStats, profile: HostProfile) -> float:
    """Resident bytes of a CPU worker besides its `MemoryEstimate`: the interpreter with what a
    worker imports, the runtime its first optimizer and step add, and the data set it loaded.

    [Note: a worker's own memory] A worker's peak resident memory on a CPU host is its model
    states, activations and buffers (`memory_per_rank`) plus three terms that do not scale with
    the layout:

    * ``profile.baseline_bytes``: a fresh interpreter that imported torch, the trainer and the
      strategy packages (calibrated; 277 MiB on the development host);
    * ``profile.runtime_bytes``: what the first optimizer and the first step add whatever the
      model. ``torch.optim.Optimizer.__init__`` imports ``torch._dynamo`` lazily
      (``torch._compile._disable_dynamo``: ~220 modules, ~23 MiB of Python objects), and the
      first forward, backward and update touch the pages of the kernels they run (~13 MiB of
      libtorch's code). Calibrated by a fresh worker that builds the library's optimizer and runs
      two steps of a miniature of the default model (`planner.worker_memory.fresh_worker_memory`;
      44 MiB on the development host);
    * ``stats.data_bytes``: the token stream or (inputs, targets) tensors of the job's data set,
      which every worker loads whole (`data.datasets.build_datasets`; the pydoc corpus: 465k
      int64 tokens, 3.5 MiB). Counted from the data set itself by `measure.stats`;
    * ``stats.import_bytes``: a user's model factory (``model.name = "pkg.module:function"``)
      and the libraries it imports and builds with. transformers and a GPT-2 built from its
      config add ~120 MiB to each worker; the built-ins add nothing. Measured by a fresh
      interpreter (`planner.worker_memory.factory_import_bytes`) when the planner counts
      the model.

    Measured phase by phase in one mlp tiny worker (VmHWM, 2026-11-25): imports 277 MiB, data
    set +7-11, optimizer and strategy +28, first step +14, then flat: 329 MiB against the 278
    MiB the baseline alone predicted (the 13-22% under-prediction of planner2's benchmark). The
    rest of the data set's part (the corpus text, the tokenizer's transient list) and DTensor's
    or FSDP2's own first-use pages (a few MiB more on tp and ZeRO layouts) are not modelled."""
    return profile.baseline_bytes + profile.runtime_bytes + stats.data_bytes + stats.import_bytes


def _in_flight(layout: Layout) -> list[int]:
    """Micro-batches whose activations a stage holds at once, from the schedule itself."""
    if layout.pp <= 1:
        return [1]
    # accumulation reruns the same m-micro-batch program, so it adds nothing in flight
    return list(_peaks(layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages))


@cache
def _peaks(
    schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int
) -> tuple[int, ...]:
    peaks = peak_activations(
        compute_program(schedule, num_ranks, num_microbatches, virtual_stages)[0]
    )
    return tuple(peaks[r] for r in range(num_ranks))


def _starts(stage_blocks: Sequence[Sequence[BlockStats]]) -> list[int]:
    """The model index of each stage's first block (stages in model order)."""
    starts, at = [], 0
    for blocks in stage_blocks:
        starts.append(at)
        at += len(blocks)
    return starts


def _recomputed(
    stats: ModelStats, layout: Layout, blocks: Sequence[BlockStats]
) -> Sequence[BlockStats]:
    """The units whose activations ``blocks`` keep: [Note: recomputed layers of a user's model]
    The runtime recomputes a model's units (`models.base.BlockModel.units`), which for a user's
    one-module model are its repeated layers, not the one block the trainer sees: a recomputing
    rank keeps each layer's input and rebuilds one layer at a time. Without a pipeline its
    activations are counted on the layer view (`ModelStats.layer_blocks`, [Note: layer view] in
    measure/layer_stats.py), whose first and last blocks also hold what comes before and after
    the layers (embeddings; final norm, head and loss: the largest block rebuilt, as the head's
    saves are kept); its model states stay the whole model's (the view holds a tie twice).
    Counted as one block, a recomputing Llama-3-8B kept every activation (recomputation saved
    nothing) and no layout of it fitted."""
    if layout.pp == 1 and layout.recompute and stats.layer_blocks:
        return stats.layer_blocks
    return blocks


def _activation_sizes(
    layout: Layout, blocks: Sequence[BlockStats], mb_samples: float, start: int = 0
) -> tuple[float, float]:
    """(bytes one micro-batch in flight keeps on ``blocks``, bytes added once while a
    recomputing backward rebuilds one block's saved tensors). ``start``: the model index of
    ``blocks[0]`` (``every:K`` recomputes the blocks whose index is a multiple of K)."""
    tp = layout.tp
    # Activations: tensor parallel splits the saved tensors between a column-parallel output and
    # a row-parallel input; the rest every rank holds whole ([Note: tensor-parallel activations]
    # in measure/tp_stats.py). Those scale with the samples; on top, what a pass saves whatever its
    # batch (autocast's weight copies, this rank's shard of them; [Note: counted under autocast])
    saved = sum(b.saved_per_tp_rank(tp) for b in blocks) * mb_samples
    fixed = [b.saved_fixed_bytes * b.bytes_per_tp_rank(tp) / max(b.param_bytes, 1) for b in blocks]
    if layout.recompute:
        # a recomputing block keeps only its input (the previous block's output, counted as
        # its own output: the same size along the residual stream) past the forward, and one
        # block's saved tensors are rebuilt at a time during backward; the others keep theirs
        covered = [layout.recomputes(start + k) for k in range(len(blocks))]
        kept, rebuilt = 0.0, 0.0
        for b, f, rec in zip(blocks, fixed, covered, strict=True):
            full = b.saved_per_tp_rank(tp) * mb_samples + f
            keeps, rebuilds = b.output_bytes * mb_samples, full
            if layout.recompute_ops:  # [Note: pricing selective recomputation]
                keeps, rebuilds = ops_activations(b, tp, mb_samples, f)
            kept += keeps if rec else full
            rebuilt = max(rebuilt, rebuilds if rec else 0.0)
        return kept, rebuilt
    return saved + sum(fixed), 0.0


def _ties_held_twice(blocks: Sequence[BlockStats], tp: int) -> float:
    """Bytes per tensor-parallel rank that ``blocks`` count again for a tensor an earlier one
    of them holds (`BlockStats.tied`): a rank whose stages share a tie (GPT-2's ``wte`` under
    ZBV, the first and the last stage on rank 0) holds one Parameter ([Note: several layer
    stages per rank] in pipeline.layer_stage)."""
    seen: set[str] = set()
    twice = 0.0
    for block in blocks:
        for name, nbytes, divisor in block.tied:
            if name in seen:
                twice += nbytes / tp if tp > 1 and divisor % tp == 0 else nbytes
            seen.add(name)
    return twice


def _stage(
    stats: ModelStats,
    layout: Layout,
    blocks: Sequence[BlockStats],
    mb_samples: float,
    activations: float,
    in_flight: int,
    stage_index: int,
) -> MemoryEstimate:
    """One rank holding ``blocks`` with ``activations`` bytes at its peak, ``in_flight``
    micro-batches (of one stage each) in flight."""
    tp, dp = layout.tp, layout.dp
    # tensor parallel splits the sharded tensors and leaves the rest whole on every rank
    # ([Note: tensor-parallel shards] in planner/types.py)
    p_bytes = sum(b.bytes_per_tp_rank(tp) for b in blocks)
    if stats.layer_blocks:  # only the layer view carries ties
        p_bytes -= _ties_held_twice(blocks, tp)
    weights = p_bytes / dp if layout.zero >= 2 else p_bytes  # FSDP2 keeps only the shard
    # FSDP2 without gradient sync keeps unsharded gradients: every backward of a step but its
    # last (accumulation micro-steps; a ZeRO stage's micro-batches, [Note: ZeRO inside stages]
    # in pipeline/sharded.py) accumulates them whole, so only a step of one backward holds
    # no more than the shard at its peak
    backwards = layout.grad_accum * (layout.microbatches if layout.pp > 1 else 1)
    grads = p_bytes / dp if layout.zero >= 2 and backwards == 1 else p_bytes
    state_bytes = p_bytes * stats.optimizer_state_per_param
    optimizer = state_bytes / dp if layout.zero >= 2 else state_bytes
    if layout.sync == "ps":  # workers keep no optimizer state; servers hold it (1/K each)
        optimizer = 0.0
    if layout.pp > 1 and layout.schedule == "pipedream":
        # Weight stashing with the default pipeline.pipedream_update = "step" (an update every
        # m micro-batches): ceil((p - 1 - s) / m) + 1 versions, the live one counted above.
        # The runtime's stash bound; one line here because its home moves in the pending
        # merge (pipeline/partition.stashed_copies -> pipeline/schedule/pipedream.stash_bound).
        copies = -(-(layout.pp - 1 - stage_index) // layout.microbatches) + 1
        weights += p_bytes * (copies - 1)
    # DDP runs with gradient_as_bucket_view=True (parallel/data_parallel.py): the gradients
    # are views into its buckets, so its buckets cost nothing beyond `grads`.
    buffers = 0.0
    if layout.zero == 3:
        # the gathered parameters of the current and the prefetched block; a user's model
        # ([Note: FSDP units of a user's model] in measure/layer_stats.py): its root unit, gathered
        # from the root's forward to its post-forward (the whole forward) and again through the
        # whole backward, beside the current and the prefetched layer
        gathered = 2 * max(b.bytes_per_tp_rank(tp) for b in blocks)
        if stats.fsdp_units and layout.pp == 1:
            (root, _), *layers = stats.fsdp_units
            units = root + 2 * max((b for b, _ in layers), default=0.0)
            gathered = p_bytes * min(units / max(stats.param_bytes, 1), 1.0)
        buffers += gathered
    if layout.zero == 2:
        # all blocks' gathered parameters, kept from forward to backward (a ZeRO stage: from
        # the step's first forward to its last backward, every stage the rank holds)
        buffers += p_bytes
    if layout.pp > 1:
        out = max(b.output_bytes for b in blocks) * mb_samples
        # a received activation and a received gradient per micro-batch in flight: the runtime
        # posts as many receives ahead ([Note: early receives] in pipeline/runtime.py)
        buffers += 2 * out * in_flight
    if layout.sync == "gossip":
        # the flat model, its weighted copy and one receive buffer per in-neighbour
        graph = graph_for_round(layout.topology, layout.dp, 0)
        in_degree = max((len(graph.in_neighbours(i)) for i in range(layout.dp)), default=0)
        buffers += (in_degree + 2) * p_bytes
    if layout.sync == "localsgd":
        buffers += p_bytes  # torch's averager all-reduces one flat copy of the parameters
    if layout.sync == "ps" and layout.ps_leaves:
        # a leaf's rank (ps/leaf.py): its whole copy, gradient and sum buffers, a staging
        # buffer per remote worker of its group
        buffers += (2 + layout.ps_leaves) * p_bytes
    return MemoryEstimate(weights, grads, optimizer, activations, buffers)

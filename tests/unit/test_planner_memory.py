"""Memory per rank against hand-computed bytes (pure, milliseconds)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from polytrain.planner.memory import ALLOCATOR_SLACK, memory_per_rank, process_bytes
from polytrain.planner.partition import balanced_stages
from polytrain.planner.types import BlockStats, HostProfile, Layout, ModelStats

P = 1_000_000  # parameters per block
BLOCK = BlockStats("b", P, 4 * P, fwd_flops=1e9, saved_bytes=1000.0, output_bytes=100.0)
STATS = ModelStats("toy", (BLOCK,) * 4, dtype_bytes=4, optimizer_state_per_param=2)
WEIGHTS = 4 * 4 * P  # four blocks, fp32


def _mem(layout: Layout, mb: float = 8.0):  # type: ignore[no-untyped-def]
    return memory_per_rank(STATS, layout, balanced_stages(STATS.blocks, layout.pp), mb)


def test_ddp_replicates_model_states() -> None:
    m = _mem(Layout(dp=4))
    assert (m.weights, m.grads, m.optimizer) == (WEIGHTS, WEIGHTS, 2 * WEIGHTS)
    assert m.buffers == 0  # gradient_as_bucket_view: the buckets are the gradients
    assert m.activations == 4 * 1000.0 * 8
    assert m.total == pytest.approx((4 * WEIGHTS + 32000) * (1 + ALLOCATOR_SLACK))


def test_zero_shards_what_its_stage_says() -> None:
    z2, z3 = _mem(Layout(dp=4, zero=2)), _mem(Layout(dp=4, zero=3))
    assert (z2.weights, z2.grads, z2.optimizer) == (WEIGHTS / 4, WEIGHTS / 4, 2 * WEIGHTS / 4)
    assert z2.buffers == WEIGHTS  # gathered parameters kept from forward to backward
    assert z3.buffers == 2 * 4 * P  # the current and the prefetched block
    assert z3.model_states == z2.model_states
    assert z3.total < z2.total
    assert z3.total < _mem(Layout(dp=4)).total
    # accumulating under FSDP2 (gradient sync off until the last micro-step) keeps full grads
    assert _mem(Layout(dp=4, zero=3, grad_accum=2)).grads == WEIGHTS


def test_tensor_parallel_divides_weights_and_activations() -> None:
    m = _mem(Layout(tp=4))
    assert m.weights == WEIGHTS / 4
    assert m.activations == 4 * 1000.0 * 8 / 4


def test_tensor_parallel_leaves_the_whole_saved_tensors_whole() -> None:
    """[Note: tensor-parallel activations]: of a block's 1000 saved bytes per sample, the 250
    every rank holds whole (layer norms, the residual stream) are not divided by tp."""
    block = BlockStats("b", P, 4 * P, 1e9, 1000.0, 100.0, saved_whole_bytes=250.0)
    stats = ModelStats("toy", (block,) * 4, dtype_bytes=4, optimizer_state_per_param=2)
    m = memory_per_rank(stats, Layout(tp=2), [stats.blocks], 8.0)
    assert m.activations == 4 * (250.0 + 750.0 / 2) * 8
    assert memory_per_rank(stats, Layout(), [stats.blocks], 8.0).activations == 4 * 1000.0 * 8
    rec = memory_per_rank(stats, Layout(tp=2, recompute=True), [stats.blocks], 8.0)
    assert rec.activations == 4 * 100.0 * 8 + (250.0 + 750.0 / 2) * 8


def test_pipeline_in_flight_microbatches_come_from_the_schedule() -> None:
    # 2 stages of 2 blocks; GPipe holds all m = 8 micro-batches, 1F1B at most p - s = 2
    gpipe = _mem(Layout(pp=2, schedule="gpipe", microbatches=8), mb=1.0)
    ofob = _mem(Layout(pp=2, schedule="1f1b", microbatches=8), mb=1.0)
    assert gpipe.activations == 8 * 2 * 1000.0
    assert ofob.activations == 2 * 2 * 1000.0
    pd = _mem(Layout(pp=2, schedule="pipedream", microbatches=8), mb=1.0)
    # stage 0 stashes ceil((p - 1 - s) / m) + 1 = 2 versions (an update per step of m = 8)
    assert pd.weights == 2 * (2 * 4 * P)
    pd4 = memory_per_rank(
        STATS,
        Layout(pp=4, schedule="pipedream", microbatches=2),
        balanced_stages(STATS.blocks, 4),
        1.0,
    )
    assert pd4.weights == 3 * (4 * P)  # stage 0 of 4 with m = 2: ceil(3 / 2) + 1 = 3 versions


def test_recomputation_keeps_block_inputs_only() -> None:
    plain, rec = _mem(Layout()), _mem(Layout(recompute=True))
    assert rec.activations == 4 * 100.0 * 8 + 1000.0 * 8
    assert rec.activations < plain.activations


def test_every_kth_block_recomputes_and_the_others_keep_their_activations() -> None:
    # every:2 on four blocks: blocks 0 and 2 keep their inputs, 1 and 3 their activations;
    # in backward one recomputing block's activations are rebuilt at a time
    half = _mem(Layout(recompute=True, recompute_every=2))
    assert half.activations == 2 * 100.0 * 8 + 2 * 1000.0 * 8 + 1000.0 * 8
    assert _mem(Layout(recompute=True, recompute_every=1)) == _mem(Layout(recompute=True))
    # a pipeline stage counts its blocks by their index in the model: of six blocks in two
    # stages, every:2 recomputes 0 and 2 of stage 0 but only 4 of stage 1 (blocks 3, 4, 5),
    # which GPipe's two micro-batches in flight make the busiest
    six = ModelStats("toy", (BLOCK,) * 6, dtype_bytes=4, optimizer_state_per_param=2)
    layout = Layout(pp=2, schedule="gpipe", microbatches=2, recompute=True, recompute_every=2)
    stages = memory_per_rank(six, layout, [[BLOCK] * 3] * 2, 8)
    assert stages.activations == 2 * (100.0 * 8 + 2 * 1000.0 * 8) + 1000.0 * 8


def test_tensor_parallel_keeps_unsplit_tensors_whole() -> None:
    """[Note: tensor-parallel shards]: 3 MB split by a dimension of 12, 1 MB whole (LayerNorms,
    row-parallel biases): tp 2 and 4 split the 3 MB only; tp 8 does not divide 12, so the
    plan leaves that part whole too (the runtime's vocabulary rule)."""
    block = BlockStats("b", P, 4 * P, 1e9, 1000.0, 100.0, tp_shards=((3.0 * P, 12), (1.0 * P, 1)))
    assert block.bytes_per_tp_rank(1) == 4 * P
    assert block.bytes_per_tp_rank(2) == 1.5 * P + P
    assert block.bytes_per_tp_rank(4) == 0.75 * P + P
    assert block.bytes_per_tp_rank(8) == 4 * P
    assert block.params_per_tp_rank(2) == P * 2.5 / 4
    stats = ModelStats("toy", (block,) * 2, dtype_bytes=4, optimizer_state_per_param=2)
    m = memory_per_rank(stats, Layout(tp=2), [stats.blocks], 8.0)
    assert (m.weights, m.grads, m.optimizer) == (5 * P, 5 * P, 10 * P)
    z = memory_per_rank(stats, Layout(dp=2, tp=2, zero=2), [stats.blocks], 8.0)
    assert z.weights == 2.5 * P  # ZeRO shards this rank's tp share over dp


def test_a_parameter_server_holds_its_shard_its_gradient_buffer_and_the_optimizer() -> None:
    """Measured on gpt tiny with one server: 4 x the parameters (AdamW). A server can be the
    busiest rank: the prediction's memory per rank is the larger of worker and server."""
    from polytrain.planner.cluster import parse_cluster
    from polytrain.planner.cost import Env, predict
    from polytrain.planner.memory import ps_server_memory

    one = ps_server_memory(STATS, Layout(dp=2, sync="ps", ps_servers=1))
    assert (one.weights, one.grads, one.optimizer) == (WEIGHTS, WEIGHTS, 2 * WEIGHTS)
    two = ps_server_memory(STATS, Layout(dp=2, sync="ps", ps_servers=2))
    assert two.model_states == one.model_states / 2
    layout = Layout(dp=2, sync="ps", ps_servers=1)
    pred = predict(layout, STATS, Env(parse_cluster("1x3xcpu")), 8)
    worker = _mem(layout, 4.0)
    assert pred.memory_per_rank == max(worker.total, one.total) == one.total


def test_a_worker_also_holds_its_imports_runtime_and_data_set() -> None:
    """[Note: a worker's own memory]: the calibrated import baseline and runtime (the first
    optimizer's torch._dynamo, the first step's kernel pages) and the job's data set, whatever
    the layout; mlp tiny on the development host: 277 + 44 + 3.5 MiB."""
    mib = 2**20
    profile = HostProfile("x", "cpu", {}, 1.0, baseline_bytes=277 * mib, runtime_bytes=44 * mib)
    stats = ModelStats("toy", (BLOCK,), data_bytes=465_126 * 8)
    assert process_bytes(stats, profile) == 277 * mib + 44 * mib + 465_126 * 8
    # an old profile (no runtime measured) and a model without data: the baseline alone
    assert process_bytes(STATS, HostProfile("x", "cpu", {}, 1.0, baseline_bytes=1e8)) == 1e8


def test_autocast_weight_copies_count_once_per_pass_not_per_sample() -> None:
    """[Note: counted under autocast]: the fixed part of a block's saved bytes is added once
    per micro-batch in flight (and for the one block recomputed at a time), never times the
    samples; a tensor-parallel rank holds its shard of it."""
    fixed = BlockStats("b", P, 4 * P, 1e9, 1000.0, 100.0, saved_fixed_bytes=2 * P)
    stats = ModelStats("toy", (fixed,) * 4, dtype_bytes=4, optimizer_state_per_param=2)

    def mem(layout: Layout):  # type: ignore[no-untyped-def]
        return memory_per_rank(stats, layout, balanced_stages(stats.blocks, layout.pp), 8.0)

    assert mem(Layout()).activations == 4 * 1000.0 * 8 + 4 * 2 * P
    assert mem(Layout(recompute=True)).activations == 4 * 100.0 * 8 + 1000.0 * 8 + 2 * P
    assert mem(Layout(tp=2)).activations == 4 * 1000.0 * 8 / 2 + 4 * P


def test_a_tie_whose_stages_share_a_rank_is_held_once() -> None:
    """GPT-2's wte on the first and the last layer stage: under ZBV both sit on rank 0 as one
    Parameter ([Note: several layer stages per rank] in pipeline.layer_stage), under 1F1B on
    two ranks, each holding it."""
    tie = 2 * P
    end = BlockStats("end", 2 * P, 8 * P, 1e9, 1000.0, 100.0, tied=(("wte", float(tie), 1),))
    layers = (end, BLOCK, BLOCK, end)  # a layer view: the one block the trainer sees aside
    stats = ModelStats("tied", (BLOCK,), layer_blocks=layers)
    zbv = Layout(pp=2, schedule="zbv", microbatches=4)

    def weights(stats: ModelStats, layout: Layout, stages: list[list[BlockStats]]) -> float:
        return memory_per_rank(stats, layout, stages, 2.0).weights

    assert weights(stats, zbv, [[b] for b in layers]) == 16 * P - tie  # rank 0
    untied = [[replace(b, tied=())] for b in layers]
    assert weights(stats, zbv, untied) == 16 * P
    one_f = Layout(pp=2, schedule="1f1b", microbatches=4)
    halves = [list(layers[:2]), list(layers[2:])]
    assert weights(stats, one_f, halves) == 12 * P  # each rank its own

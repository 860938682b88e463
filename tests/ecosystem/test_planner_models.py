"""The planner on users' own models: transformers GPT-2 (tied embeddings) and BERT (named inputs,
a mask built from the input values), from tiny configs with random weights.

`measure.stats` counts them (BERT's data-dependent mask on the CPU: [Note: data-dependent
forwards]) whole and, for pipelines, stage by stage as the runtime's layer pipeline cuts them
([Note: layer view] in measure/layer_stats.py); `polytrain plan` ranks layouts for them; the
planner's model states are the bytes a run held, on one rank and on each stage of a layer
pipeline, and a rank's peak is the run's within 10% once the worker's import of the factory
(transformers) is counted ([Note: a worker's own memory] in planner/memory.py).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from polytrain.config.io import job_from_dict
from polytrain.config.job import JobConfig
from polytrain.data.datasets import build_datasets
from polytrain.measure import layer_stats
from polytrain.measure.stats import model_stats
from polytrain.models.registry import build_model
from polytrain.planner.cluster import parse_cluster
from polytrain.planner.cost import Env, predict
from polytrain.planner.memory import memory_per_rank, process_bytes
from polytrain.planner.search import enumerate_layouts
from polytrain.planner.types import HostProfile, Layout, ModelStats
from polytrain.planner.validate import Trial, TrialSpec, held_state_bytes, run_trials
from polytrain.planner.worker_memory import fresh_worker_memory
from tests.helpers import hf_models
from tests.helpers.cli import run_main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

_FACTORY = "tests.helpers.hf_models:make_"


def _fields(name: str, data: Path) -> dict[str, object]:
    return {
        "model.name": _FACTORY + name,
        "data.source": str(hf_models.write_data(name, data)),
        "train.global_batch_size": 8,
    }


def _job(fields: dict[str, object]) -> JobConfig:
    sections: dict[str, dict[str, object]] = {}
    for key, value in fields.items():
        section, _, field = key.partition(".")
        sections.setdefault(section, {})[field] = value
    return job_from_dict(sections)


def _peak_against_a_run(
    stats: ModelStats, layout: Layout, fields: dict[str, object], tmp_path: Path
) -> tuple[float, Trial]:
    """A one-rank ``layout`` of ``fields`` run for three steps of 8 samples: its model states
    are the planner's, its peak the planner's within 10% (returned: predicted peak, the run)."""
    (trial,) = run_trials([TrialSpec(layout, 0.01)], fields, tmp_path / "runs", steps=3)
    assert trial.ok, trial.error
    estimate = memory_per_rank(stats, layout, [stats.blocks], 8.0)
    assert estimate.model_states == trial.state_bytes
    baseline, runtime, _ = fresh_worker_memory()
    profile = HostProfile("x", "cpu", {}, 1.0, baseline_bytes=baseline, runtime_bytes=runtime)
    predicted = estimate.total + process_bytes(stats, profile)
    assert abs(predicted / trial.peak_bytes - 1) < 0.10, (predicted / 2**20, trial.peak_bytes)
    return predicted, trial


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_stats_count_each_parameter_once(tmp_path: Path, name: str) -> None:
    job = _job(_fields(name, tmp_path / "data.safetensors"))
    stats = model_stats(job, imports=False)
    _, _, spec = build_datasets(job.data, 8)
    with torch.device("meta"):
        model = build_model(job.model, spec, 0)
    held = sum(p.numel() for p in model.parameters())  # a tied tensor once
    assert sum(b.params for b in stats.blocks) == held
    # the tensor-parallel plan's shards hold the tie once too (a tp rank holds it once)
    assert sum(n for b in stats.blocks for n, _ in b.tp_shards) == stats.param_bytes
    assert sum(b.fwd_flops for b in stats.blocks) > 0
    assert stats.name == _FACTORY + name


def test_plan_ranks_layouts_for_a_transformers_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = hf_models.write_data("bert", tmp_path / "bert.safetensors")
    argv = ["plan", "--model", _FACTORY + "bert", "--data", str(data), "--batch-size", "8"]
    code, out, err = run_main([*argv, "--cluster", "1x4xcpu", "--devices", "1:4", "--json"], capsys)
    assert code == 0, err
    plans = json.loads(out)["plans"]
    layouts = {p["layout"] for p in plans}
    assert {"dp1", "dp2"} <= layouts, layouts
    assert all(p["step_s"] > 0 for p in plans)


def test_one_rank_states_and_peak_match_a_run(tmp_path: Path) -> None:
    fields = _fields("gpt2", tmp_path / "gpt2.safetensors")
    stats = model_stats(_job(fields))
    assert stats.import_bytes > 50 * 2**20  # transformers and its GPT-2 in each worker
    predicted, trial = _peak_against_a_run(stats, Layout(dp=1), fields, tmp_path)
    # without the factory's imports the worker's own memory is short by a fifth and more
    assert (predicted - stats.import_bytes) / trial.peak_bytes < 0.85


def _layered(name: str, data: Path) -> dict[str, object]:
    layers = {"gpt2": {"n_layer": 4}, "bert": {"num_hidden_layers": 4}}[name]
    return {**_fields(name, data), "model.args": layers}


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_the_layer_view_has_a_block_per_layer_and_the_tie_on_both_ends(
    tmp_path: Path, name: str
) -> None:
    job = _job(_layered(name, tmp_path / "data.safetensors"))
    stats = model_stats(job, imports=False)
    assert len(stats.blocks) == 1 and len(stats.layer_blocks) == 4
    _, _, spec = build_datasets(job.data, 8)
    with torch.device("meta"):
        model = build_model(job.model, spec, 0)
    # GPT-2's wte is also its lm_head: the first stage and the last each hold it
    twice = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert sum(b.params for b in stats.layer_blocks) == twice
    assert stats.layer_blocks[1].params == stats.layer_blocks[2].params  # one layer alone
    # every stage re-runs the part before the layers (only the first trains it)
    whole = stats.blocks[0].fwd_flops
    assert whole <= sum(b.fwd_flops for b in stats.layer_blocks) < 1.2 * whole


def test_a_model_counted_on_the_cpu_copies_itself_per_layer_only_when_small(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BERT's mask reads its inputs, so it is counted on the CPU, where the layer view's copies
    of the model are real: past the cap it gets no layer view (no pipeline is offered)."""
    job = _job(_layered("bert", tmp_path / "data.safetensors"))
    monkeypatch.setattr(layer_stats, "_REAL_COPIES_BYTES", 0)
    stats = model_stats(job, imports=False)
    assert stats.blocks and not stats.layer_blocks
    # GPT-2 counts on meta (its layer view costs nothing there) but is timed on the CPU
    gpt2 = _job(_layered("gpt2", tmp_path / "gpt2.safetensors"))
    timed = model_stats(gpt2, imports=False, measure=True, batch=2, repeats=1)
    assert timed.blocks[0].fwd_s > 0 and len(timed.layer_blocks) == 4
    assert all(b.fwd_s is None for b in timed.layer_blocks)  # untimed: priced from FLOPs


def test_the_search_offers_layer_pipelines_the_runtime_runs(tmp_path: Path) -> None:
    stats = model_stats(_job(_layered("gpt2", tmp_path / "data.safetensors")), imports=False)
    cluster = parse_cluster("1x4xcpu")
    found = list(enumerate_layouts(4, stats, cluster, 8))
    piped = [lay for lay in found if lay.pp > 1]
    assert {(lay.pp, lay.tp) for lay in piped} == {(2, 1), (2, 2), (4, 1)}
    assert all(lay.schedule != "pipedream" for lay in piped)  # pre-flight refuses it here
    env = Env(cluster)
    pred = predict(piped[0], stats, env, 8)
    assert sum(pred.layout.partition) == 4  # layers per stage, as pipeline.partition takes them


def test_the_layer_view_splits_each_layer_by_the_whole_models_plan(tmp_path: Path) -> None:
    """tp inside a layer stage splits what the stage owns by the plan resolved on the whole
    model: the layers' shards are the whole model's, the tie held by both ends (one shard
    each per tp rank), and each layer carries its plan's modules."""
    stats = model_stats(_job(_layered("gpt2", tmp_path / "data.safetensors")), imports=False)
    (whole,), layers = stats.blocks, stats.layer_blocks
    (tie,) = {t for b in layers for t in b.tied}
    assert [bool(b.tied) for b in layers] == [True, False, False, True]
    assert sum(n for b in layers for n, _ in b.tp_shards) == whole.param_bytes + tie[1]
    for tp in (2, 4):
        on_tie = tie[1] / tp if tie[2] % tp == 0 else tie[1]
        held = sum(b.bytes_per_tp_rank(tp) for b in layers)
        assert held == pytest.approx(whole.bytes_per_tp_rank(tp) + on_tie)
    assert whole.tp_modules is not None
    assert sum(len(b.tp_modules or ()) for b in layers) == len(whole.tp_modules)


def test_zero_prices_the_units_fsdp2_shards(tmp_path: Path) -> None:
    """ZeRO shards each repeated layer and the root ([Note: FSDP units of a user's model]):
    five collectives each way for four layers, and ZeRO-3 holds the root and two layers
    gathered, not the model."""
    stats = model_stats(_job(_layered("gpt2", tmp_path / "data.safetensors")), imports=False)
    units = stats.fsdp_units
    assert len(units) == 5 and sum(b for b, _ in units) == stats.param_bytes
    assert units[1] == units[2] == units[3] == units[4]  # the layers; the root holds the tie
    env = Env(parse_cluster("1x2xcpu"))
    whole = replace(stats, fsdp_units=())
    for zero in (2, 3):
        layout = Layout(dp=2, zero=zero)
        split, one = predict(layout, stats, env, 8), predict(layout, whole, env, 8)
        assert split.breakdown["dp_comm"] > one.breakdown["dp_comm"]  # more, smaller messages
    mem = memory_per_rank(stats, Layout(dp=2, zero=3), [stats.blocks], 4.0)
    mem_whole = memory_per_rank(whole, Layout(dp=2, zero=3), [whole.blocks], 4.0)
    # the root (embeddings, head: the tie) stays gathered through each pass beside two layers
    root, layer = units[0][0], units[1][0]
    assert mem.buffers == pytest.approx(root + 2 * layer)
    assert mem_whole.buffers == pytest.approx(2 * stats.param_bytes)


def test_each_stage_holds_the_states_the_planner_gives_it(tmp_path: Path) -> None:
    fields = _layered("gpt2", tmp_path / "gpt2.safetensors")
    stats = model_stats(_job(fields), imports=False)
    layout = Layout(pp=2, schedule="1f1b", microbatches=2)
    pred = predict(layout, stats, Env(parse_cluster("1x2xcpu")), 8)
    counts = list(pred.layout.partition)
    spec = TrialSpec(layout, 0.01, extra={"pipeline.partition": counts})
    (trial,) = run_trials([spec], fields, tmp_path / "runs", steps=2)
    assert trial.ok, trial.error
    start = 0
    for rank, count in zip(trial.ranks, counts, strict=True):
        blocks = stats.layer_blocks[start : start + count]
        start += count
        # AdamW in fp32: weights, gradients and two moments
        assert 4 * sum(b.param_bytes for b in blocks) == held_state_bytes(rank)


def test_a_tensor_parallel_stage_holds_the_states_the_planner_gives_it(tmp_path: Path) -> None:
    """pp = 2 x tp = 2 over GPT-2's layers: every rank holds its stage's tp shards, as the
    planner prices them (`plan --layout` asks for this one)."""
    fields = _layered("gpt2", tmp_path / "gpt2.safetensors")
    stats = model_stats(_job(fields), imports=False)
    layout = Layout(pp=2, tp=2, schedule="1f1b", microbatches=2)
    pred = predict(layout, stats, Env(parse_cluster("1x4xcpu")), 8)
    counts = list(pred.layout.partition)
    spec = TrialSpec(layout, 0.01, extra={"pipeline.partition": counts})
    (trial,) = run_trials([spec], fields, tmp_path / "runs", steps=2)
    assert trial.ok, trial.error
    stages = [stats.layer_blocks[: counts[0]], stats.layer_blocks[counts[0] :]]
    held = sorted(held_state_bytes(rank) for rank in trial.ranks)
    # AdamW in fp32: weights, gradients and two moments, on each of a stage's two tp ranks
    planned = sorted(4 * sum(b.bytes_per_tp_rank(2) for b in s) for s in stages for _ in "ab")
    assert held == planned
    assert memory_per_rank(stats, pred.layout, stages, 4.0).model_states == max(planned)


def test_zbv_holds_the_tie_once_on_the_rank_of_both_ends(tmp_path: Path) -> None:
    """ZBV puts GPT-2's first and last layer stage on rank 0, one Parameter for ``wte``
    ([Note: several layer stages per rank] in pipeline.layer_stage): the planner's model states
    are each rank's as the run held them."""
    fields = _layered("gpt2", tmp_path / "gpt2.safetensors")
    stats = model_stats(_job(fields), imports=False)
    layout = Layout(pp=2, schedule="zbv", microbatches=2)
    spec = TrialSpec(layout, 0.01, extra={"pipeline.partition": [1, 1, 1, 1]})
    (trial,) = run_trials([spec], fields, tmp_path / "runs", steps=2)
    assert trial.ok, trial.error
    held = [held_state_bytes(rank) for rank in trial.ranks]
    layers = stats.layer_blocks
    tie = layers[0].tied[0][1]
    assert held[0] == 4 * (layers[0].param_bytes + layers[3].param_bytes - tie)
    assert held[1] == 4 * (layers[1].param_bytes + layers[2].param_bytes)
    # without activations the busiest rank is the one with the most states: rank 0's
    still = [[replace(b, saved_bytes=0.0, saved_fixed_bytes=0.0, output_bytes=0.0)] for b in layers]
    assert memory_per_rank(stats, layout, still, 4.0).model_states == held[0] == max(held)


def test_a_llama_at_a_long_context_peaks_as_predicted(tmp_path: Path) -> None:
    """A transformers Llama (GQA, SwiGLU) at T = 512, counted on meta: its attention saves
    O(T) in the run's fused kernel, where meta's math path had counted 4 heads x T x T scores
    per layer (several times the rest of its activations: [Note: fused attention's saved
    tensors]); recomputed, the runtime rebuilds one layer at a time ([Note: recomputed layers
    of a user's model]), or keeps its matmuls' and attention's outputs (selective, [Note:
    selective recomputation's statistics] in measure/ops_stats.py). The predicted peak is the
    run's within 10%, with and without recomputation (one count of the model serves all)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    seq = 512
    args = {"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128}
    args |= {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300}
    fields = {
        "model.name": _FACTORY + "llama",
        "model.args": {**args, "max_position_embeddings": seq},
        "model.block_size": seq,
        "data.source": str(corpus),
        "data.tokenizer": "byte",
        "train.global_batch_size": 8,
    }
    stats = model_stats(_job(fields))
    kept, _ = _peak_against_a_run(stats, Layout(dp=1), fields, tmp_path / "kept")
    rebuilt, _ = _peak_against_a_run(stats, Layout(dp=1, recompute=True), fields, tmp_path / "re")
    assert rebuilt < kept
    # selectively ([Note: selective recomputation's statistics] in measure/ops_stats.py)
    ops = Layout(dp=1, recompute=True, recompute_ops=True)
    selective, _ = _peak_against_a_run(stats, ops, fields, tmp_path / "ops")
    assert rebuilt < selective < kept

"""Users' own models: transformers GPT-2 (tied), Llama, BERT, ResNet (BatchNorm) and ViT,
built from tiny configs with random weights, match the single-process run under each strategy,
and their exported weights load back into the original class with no key changes (issue 12).

Strategies: dp, ZeRO-3, sync parameter server (flat, and with leaf servers), GPipe and 1F1B
pipelines over the models' repeated layers (GPT-2's tied ``wte``/``lm_head`` on the first and
last stage), and dp x pp (world 4), also with ZeRO-3 inside the stages. Tolerance: every
parameter within 2e-5 (absolute) of the single-process run after 3
AdamW steps (float32 reassociation of the all-reduced means, micro-batch sums and synchronised
BatchNorm statistics; measured differences are 0 to 2.3e-6; per-replica BatchNorm misses).
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from polytrain.testing import assert_state_close, run_job
from tests.helpers import hf_models
from tests.helpers.hf_models import hf_job

# A reference run and a layout run of a real model: more than the suite-wide 300 s when the
# machine is shared (each process imports transformers).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODELS = ["gpt2", "llama", "bert", "resnet", "vit"]
ATOL = 2e-5
PIPE = {"pp": 2}
# name -> (world size, sections).
STRATEGIES: dict[str, tuple[int, dict[str, Any]]] = {
    "dp2": (2, {"parallel": {"dp": 2}}),
    "zero3-dp2": (2, {"parallel": {"dp": 2, "zero": 3}}),
    "ps-sync": (3, {"parallel": {"sync": "ps"}, "ps": {"servers": 1, "mode": "sync"}}),
    # Leaf servers: 2 emulated hosts x 2 workers, one leaf per host ([Note: leaf servers]).
    "ps-leaves": (
        5,
        {"parallel": {"sync": "ps"}, "ps": {"servers": 1, "leaves": "host", "ranks_per_host": 2}},
    ),
    "gpipe-pp2": (2, {"parallel": PIPE, "pipeline": {"schedule": "gpipe", "microbatches": 2}}),
    "1f1b-pp2": (2, {"parallel": PIPE, "pipeline": {"schedule": "1f1b", "microbatches": 2}}),
    "dp2-pp2": (
        4,
        {"parallel": {"dp": 2, "pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}},
    ),
    # ZeRO-3 inside the stages (pipeline.sharded): each stage's layers sharded over dp
    "zero3-dp2-pp2": (
        4,
        {
            "parallel": {"dp": 2, "pp": 2, "zero": 3},
            "pipeline": {"schedule": "1f1b", "microbatches": 2},
        },
    ),
}
# Tensor parallel: a transformers model's own base_model_tp_plan (Llama publishes one), else
# polytrain's plan for its family (core.tp_plans.TRANSFORMERS_PLANS): GPT-2's Conv1D, fused
# qkv and tied wte/lm_head, BERT and ViT in Megatron's pattern, ResNet's classifier.
# Recomputation of each layer inside the stages of a layer pipeline.
RECOMPUTE: dict[str, tuple[int, dict[str, Any]]] = {
    "1f1b-pp2-recompute": (
        2,
        {
            "parallel": {**PIPE, "recompute": True},
            "pipeline": {"schedule": "1f1b", "microbatches": 2},
        },
    ),
}
TENSOR_PARALLEL: dict[str, tuple[int, dict[str, Any]]] = {
    "tp2": (2, {"parallel": {"tp": 2}}),
    # tp inside the stages of a pipeline over the model's layers (GPT-2: the tie spans stages)
    "pp2-tp2": (
        4,
        {"parallel": {"pp": 2, "tp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}},
    ),
}
# BatchNorm in a pipeline matches one process only with one micro-batch (docs/models.md):
# ResNet's pipelines run one micro-batch; under dp x pp its stages' BatchNorms sync over dp.
FULL_MATRIX = [(model, strategy) for model in MODELS for strategy in STRATEGIES]
FULL_MATRIX += [(model, "tp2") for model in MODELS if model != "gpt2"]  # gpt2: its own test
FULL_MATRIX += [(model, "pp2-tp2") for model in MODELS]
FULL_MATRIX += [("gpt2", "1f1b-pp2-recompute"), ("llama", "1f1b-pp2-recompute")]
# [Note: the CI matrix] The full matrix is 46 model x strategy pairs plus the GPT-2 tp test, 47
# multi-process runs and 5 references (about fifteen minutes on 2 cores), more than half of the
# suite's budget. By default every strategy and the recomputation row run on at least two
# models (test_the_ci_matrix_keeps_its_promise checks it) and every model under at least
# two strategies, chosen where each model's trap is: GPT-2's tie across pipeline
# stages (also split by tp inside them, or sharded by ZeRO-3 inside them) and under ZeRO-3 and
# leaf servers, BatchNorm under dp / dp x pp / parameter servers (flat and with leaves), Llama's
# rotary tables and masks across stages and its own tp plan, BERT's padding mask; GPT-2 under tp has
# its own test (fused qkv, tie and export in one run), and the export test's 1F1B runs (GPT-2,
# Llama, ResNet) are held to one process as well. POLYTRAIN_FULL_MATRIX=1 runs every pair
# (run in full when the layer pipelines and the tp plans landed; docs/models.md).
CI_MATRIX = [
    ("gpt2", "pp2-tp2"),
    ("gpt2", "zero3-dp2"),
    ("gpt2", "zero3-dp2-pp2"),
    ("gpt2", "1f1b-pp2-recompute"),
    ("gpt2", "ps-leaves"),
    ("llama", "1f1b-pp2-recompute"),
    ("llama", "gpipe-pp2"),
    ("llama", "ps-sync"),
    ("llama", "tp2"),
    ("llama", "zero3-dp2"),
    ("llama", "zero3-dp2-pp2"),
    ("llama", "pp2-tp2"),
    ("bert", "dp2"),
    ("bert", "gpipe-pp2"),
    ("resnet", "dp2"),
    ("resnet", "dp2-pp2"),
    ("resnet", "ps-sync"),
    ("resnet", "ps-leaves"),
    ("vit", "1f1b-pp2"),
    ("vit", "dp2-pp2"),
]
FULL = os.environ.get("POLYTRAIN_FULL_MATRIX") == "1"
CASES = FULL_MATRIX if FULL else CI_MATRIX
EXPORTED = MODELS if FULL else ["gpt2", "llama", "resnet"]


def sections_of(model: str, strategy: str) -> tuple[int, dict[str, Any]]:
    world, sections = {**STRATEGIES, **TENSOR_PARALLEL, **RECOMPUTE}[strategy]
    if model == "resnet" and "pipeline" in sections:
        sections = {**sections, "pipeline": {**sections["pipeline"], "microbatches": 1}}
    return world, sections


@cache
def data_file(model: str) -> Path:
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix=f"polytrain-{model}-"))
    return hf_models.write_data(model, folder / "data.safetensors")


@cache
def reference(model: str) -> dict[str, Any]:
    return run_job(hf_job(model, data_file(model)), timeout_s=300)


# [Note: key biases] Softmax is invariant to adding one vector to every key, so an attention's
# key bias has gradient 0 in exact arithmetic (ViT's measured 5e-11, against 3e-4 for the query
# bias). AdamW divides that rounding noise by its own RMS, so the bias takes steps of up to lr
# whose sign is rounding: any reassociation (a tp split of the key projection) moves it by up
# to lr per step (ViT tp2: 2.4e-5). These biases are compared at lr x steps, a bound; every
# other parameter at ATOL.
KEY_BIASES = (".attention.k_proj.bias", ".attention.self.key.bias")
KEY_BIAS_ATOL = 1e-3 * 3


def assert_matches(out: dict[str, Any], ref: dict[str, Any]) -> None:
    """Losses and every parameter within ATOL of the one-process run ([Note: key biases])."""
    assert out["losses"] == pytest.approx(ref["losses"], abs=ATOL)
    keys = [k for k in ref["state"] if k.endswith(KEY_BIASES)]
    plain = {k: v for k, v in out["state"].items() if k not in keys}
    assert_state_close(plain, {k: v for k, v in ref["state"].items() if k not in keys}, atol=ATOL)
    if keys:
        biases = {k: out["state"][k] for k in keys}
        assert_state_close(biases, {k: ref["state"][k] for k in keys}, atol=KEY_BIAS_ATOL)


@pytest.mark.parametrize(("model", "strategy"), CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_matches_single_process(model: str, strategy: str) -> None:
    world, sections = sections_of(model, strategy)
    ref = reference(model)
    out = run_job(hf_job(model, data_file(model), world, **sections), timeout_s=300)
    assert_matches(out, ref)


def test_the_ci_matrix_keeps_its_promise() -> None:
    """[Note: the CI matrix]: each strategy (tp2 counting GPT-2's own test, 1f1b-pp2 the export
    test's runs) and the recomputation row on at least two models, each model under at least
    two strategies."""
    models_of: dict[str, set[str]] = {}
    exported = [(model, "1f1b-pp2") for model in EXPORTED]
    for model, strategy in [*CI_MATRIX, ("gpt2", "tp2"), *exported]:
        models_of.setdefault(strategy, set()).add(model)
    every = {**STRATEGIES, **TENSOR_PARALLEL, **RECOMPUTE}
    assert all(len(models_of.get(s, set())) >= 2 for s in every), models_of
    for model in MODELS:
        assert sum(model in m for m in models_of.values()) >= 2, model


@pytest.mark.parametrize("model", EXPORTED)
def test_export_loads_into_the_original_class(model: str, tmp_path: Path) -> None:
    """Exported through a 1F1B pipeline: stages gather their shares, GPT-2's tie survives; the
    run matches one process ([Note: the CI matrix] counts it as the model's 1f1b-pp2 case)."""
    path = tmp_path / "final.safetensors"
    world, sections = sections_of(model, "1f1b-pp2")
    job = hf_job(model, data_file(model), world, **sections, checkpoint={"save_final": str(path)})
    out = run_job(job, timeout_s=300)
    assert_matches(out, reference(model))
    fresh = getattr(hf_models, f"make_{model}")(None)
    weights = load_file(str(path))
    fresh.load_state_dict(weights, strict=True)  # every key the class has, no prefix
    assert set(weights) == set(fresh.state_dict())
    for key, value in fresh.state_dict().items():  # the trained values, not the fresh ones
        expected = out["state"][f"blocks.0.{key}"]
        torch.testing.assert_close(value, expected, atol=0, rtol=0, msg=key)
    if model == "gpt2":
        assert fresh.lm_head.weight is fresh.transformer.wte.weight
        torch.testing.assert_close(weights["lm_head.weight"], weights["transformer.wte.weight"])


def test_gpt2_tensor_parallel(tmp_path: Path) -> None:
    """GPT-2 at tp 2: Conv1D layers split, the fused c_attn split per q/k/v chunk, the tied
    wte/lm_head one vocabulary-split tensor; matches one process, and the export is the user's
    own unsplit, unpermuted layout, loading into a fresh GPT2LMHeadModel with the tie intact."""
    path = tmp_path / "final.safetensors"
    world, sections = sections_of("gpt2", "tp2")
    job = hf_job("gpt2", data_file("gpt2"), world, **sections, checkpoint={"save_final": str(path)})
    ref = reference("gpt2")
    out = run_job(job, timeout_s=300)
    assert_matches(out, ref)
    fresh = hf_models.make_gpt2(None)
    weights = load_file(str(path))
    fresh.load_state_dict(weights, strict=True)
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value, ref["state"][f"blocks.0.{key}"], atol=ATOL, rtol=0)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    torch.testing.assert_close(weights["lm_head.weight"], weights["transformer.wte.weight"])


def test_local_batchnorm_misses_the_single_process_run() -> None:
    """The control: per-replica BatchNorm statistics (``model.batchnorm = 'local'``) drift."""
    ref = reference("resnet")
    out = run_job(
        hf_job("resnet", data_file("resnet"), 2, parallel={"dp": 2}, model={"batchnorm": "local"}),
        timeout_s=300,
    )
    with pytest.raises(AssertionError, match="differs"):
        assert_state_close(out["state"], ref["state"], atol=ATOL)


def test_gpt2_auto_partition() -> None:
    """``pipeline.partition = 'auto'`` over GPT-2's 4 layers on 2 stages: rank 0 profiles the
    layers inside the model's own forward ([Note: layer profile]) and every rank cuts where it
    says; the partition only moves layers between stages, so the run matches one process (a
    rank cutting elsewhere would run a layer twice or not at all and miss)."""
    four = {"args": {"n_layer": 4}}
    steps = {"steps": 2, "global_batch_size": 8}
    ref = run_job(hf_job("gpt2", data_file("gpt2"), model=four, train=steps), timeout_s=300)
    job = hf_job(
        "gpt2",
        data_file("gpt2"),
        2,
        model=four,
        train=steps,
        parallel=PIPE,
        pipeline={"schedule": "1f1b", "microbatches": 2, "partition": "auto"},
    )
    out = run_job(job, timeout_s=300)
    assert len(ref["state"]) == len(out["state"]) and any(".h.3." in k for k in ref["state"])
    assert_matches(out, ref)

"""Interleaved 1F1B, ZB-H1 and ZBV reproduce the single-process run parameter by parameter.

The runtime holds several stages per rank (interleaved: stage ``s`` on rank ``s % p``; ZBV: a
V, rank 0 holding the first and the last stage, so the loss is computed on rank 0), hands
tensors over locally between neighbouring stages on one rank (ZBV's tip), and splits each
backward of the zero-bubble schedules into I (input gradient) and W (weight gradient, later).
Each case trains 4 steps and compares every parameter, the losses and the validation loss with
one process (contract 1); clipping checks the global norm over all of a rank's stages,
recomputation the I/W split under checkpointing, dp 2 x pp 2 the all-reduce over the stages
of each replica, ZBV on pp 4 a V over four ranks (8 stages of a GPT with 8 blocks).
Users' models (`LayerStage`) under these schedules: tests/ecosystem/test_layer_schedules.py.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest

from polytrain.config import JobConfig
from polytrain.testing import assert_state_close, run_job
from tests.conftest import small_job
from tests.helpers import hf_models
from tests.helpers.cli import assert_usage_error, run_main

pytestmark = pytest.mark.slow

# mlp n_layer 4: [TokenEmbedding, Dense x 4, Output] = 6 blocks; gpt n_layer 2: 4 blocks.
MLP: dict[str, Any] = {"name": "mlp", "n_layer": 4}
GPT: dict[str, Any] = {"name": "gpt", "n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16}
GPT8: dict[str, Any] = {**GPT, "n_layer": 6, "n_embd": 16}  # 8 blocks: ZBV pp 4's 8 stages
CLIP: dict[str, Any] = {"grad_clip": 0.05}  # below the gradient norm: clipping is active


def pipe(model: dict[str, Any], schedule: str, m: int, **sections: Any) -> JobConfig:
    parallel = {"pp": 2, **sections.pop("parallel", {})}
    pipeline = {"schedule": schedule, "microbatches": m, **sections.pop("pipeline", {})}
    nproc = parallel["pp"] * parallel.get("dp", 1)
    return small_job(
        model=model, parallel=parallel, pipeline=pipeline, launch={"nproc": nproc}, **sections
    )


V2 = {"virtual_stages": 2}
REFERENCES = {
    "mlp": small_job(model=MLP),
    "gpt": small_job(model=GPT),
    "mlp-clip": small_job(model=MLP, optim=CLIP),
    "gpt8": small_job(model=GPT8, train={"steps": 2}),
}
# name -> (reference, job, strategy name)
CASES: dict[str, tuple[str, JobConfig, str]] = {
    "interleaved-pp2-v2-m4": (
        "mlp",
        pipe(MLP, "interleaved-1f1b", 4, pipeline=V2),
        "interleaved-1f1b-pp2-v2-m4",
    ),
    "zb-h1-pp2-m4": ("mlp", pipe(MLP, "zb-h1", 4), "zb-h1-pp2-m4"),
    "zbv-pp2-m4": ("mlp", pipe(MLP, "zbv", 4), "zbv-pp2-m4"),
    # m < 2p - 1: ZBV's phases built for 3 micro-batches with the third dropped; accumulation.
    "zbv-pp2-m2-accum2": ("mlp", pipe(MLP, "zbv", 2, train={"grad_accum": 2}), "zbv-pp2-m2"),
    "gpt-zbv-pp2-m4": ("gpt", pipe(GPT, "zbv", 4), "zbv-pp2-m4"),
    "clip-interleaved-pp2-v2-m4": (
        "mlp-clip",
        pipe(MLP, "interleaved-1f1b", 4, pipeline=V2, optim=CLIP),
        "interleaved-1f1b-pp2-v2-m4",
    ),
    "recompute-zb-h1-pp2-m4": (
        "mlp",
        pipe(MLP, "zb-h1", 4, parallel={"recompute": True}),
        "zb-h1-pp2-m4",
    ),
    "zbv-dp2-pp2-m4": ("mlp", pipe(MLP, "zbv", 4, parallel={"dp": 2}), "zbv-pp2-m4-dp2"),
    "gpt-zbv-pp4-m4": (
        "gpt8",
        pipe(GPT8, "zbv", 4, parallel={"pp": 4}, train={"steps": 2}),
        "zbv-pp4-m4",
    ),
}


@cache
def reference(name: str) -> dict[str, Any]:
    return run_job(REFERENCES[name])


@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_process(case: str) -> None:
    ref_name, job, strategy = CASES[case]
    out = run_job(job)
    ref = reference(ref_name)
    assert out["strategy"] == strategy
    assert_state_close(out["state"], ref["state"], atol=1e-5)
    assert out["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert out["val_loss"] == pytest.approx(ref["val_loss"], abs=1e-5)  # forward-only pipeline


def test_layer_pipelines_refuse_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A transformers model runs these schedules over its own layers (`LayerStage`, several
    slices per rank; parity in tests/ecosystem/test_layer_schedules.py); what they cannot do
    is refused in pre-flight, in one line: more stages than layers (GPT-2 here has 2; ZBV on
    pp 2 cuts 4), ZeRO over several layer stages of a rank."""
    data = hf_models.write_data("gpt2", tmp_path / "data.safetensors")
    args = ["train", "--dry-run", "--model", "tests.helpers.hf_models:make_gpt2"]
    args += ["--set", f"data.source={data}", "--pp", "2", "--microbatches", "2"]
    code, _, err = run_main([*args, "--nproc", "2", "--schedule", "zbv"], capsys)
    assert_usage_error(code, err, "parallel.pp = 2 x 2 = 4 stages but the model has 2 repeated")
    args += ["--set", "model.args={n_layer=4}", "--schedule", "interleaved-1f1b"]
    args += ["--virtual-stages", "2", "--nproc", "4", "--dp", "2", "--zero", "3"]
    code, _, err = run_main(args, capsys)
    assert_usage_error(code, err, "ZeRO shards one layer stage per rank, this schedule holds 2")

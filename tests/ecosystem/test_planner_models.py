"""The planner on users' own models: transformers GPT-2 (tied embeddings) and BERT (named inputs,
a mask built from the input values), from tiny configs with random weights.

`planner.stats` counts them (BERT's data-dependent mask on the CPU: [Note: data-dependent
forwards]), `polytrain plan` ranks layouts for them, and for one rank the planner's model states
are the bytes the run held and its peak is the run's within 10% once the worker's import of the
factory (transformers) is counted ([Note: a worker's own memory] in planner/memory.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from polytrain.config.io import job_from_dict
from polytrain.config.job import JobConfig
from polytrain.data.datasets import build_datasets
from polytrain.models.registry import build_model
from polytrain.planner.memory import memory_per_rank, process_bytes
from polytrain.planner.stats import model_stats
from polytrain.planner.types import HostProfile, Layout
from polytrain.planner.validate import TrialSpec, run_trials
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


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_stats_count_each_parameter_once(tmp_path: Path, name: str) -> None:
    job = _job(_fields(name, tmp_path / "data.safetensors"))
    stats = model_stats(job, imports=False)
    _, _, spec = build_datasets(job.data, 8)
    with torch.device("meta"):
        model = build_model(job.model, spec, 0)
    held = sum(p.numel() for p in model.parameters())  # a tied tensor once
    assert sum(b.params for b in stats.blocks) == held
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
    (trial,) = run_trials([TrialSpec(Layout(dp=1), 0.01)], fields, tmp_path / "runs", steps=3)
    assert trial.ok, trial.error
    layout = Layout(dp=1)
    estimate = memory_per_rank(stats, layout, [stats.blocks], 8.0)
    assert estimate.model_states == trial.state_bytes
    baseline, runtime, _ = fresh_worker_memory()
    profile = HostProfile("x", "cpu", {}, 1.0, baseline_bytes=baseline, runtime_bytes=runtime)
    predicted = estimate.total + process_bytes(stats, profile)
    assert abs(predicted / trial.peak_bytes - 1) < 0.10, (predicted / 2**20, trial.peak_bytes)
    # without the factory's imports the worker's own memory is short by a fifth and more
    assert (predicted - stats.import_bytes) / trial.peak_bytes < 0.85

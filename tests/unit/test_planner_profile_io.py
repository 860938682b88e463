"""Host profiles round-trip through JSON; a broken file is one actionable error."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from polytrain.errors import PlanError
from polytrain.planner.profile_io import (
    cache_dir,
    fingerprint,
    load_profile,
    median_profile,
    profile_path,
    save_profile,
)
from polytrain.planner.types import Curve, HostProfile


def _profile() -> HostProfile:
    return HostProfile(
        fingerprint="abc",
        device="cpu",
        matmul_flops={"fp32": 5e10, "bf16": 1e11},
        matmul_by_size={"fp32": {128: 3e10, 512: 5e10}},
        mem_bw=2e10,
        collectives={"all_reduce": {2: Curve(((4096.0, 1e-4), (2**20, 2e-3)))}},
        startup_s=3.0,
        baseline_bytes=3e8,
        runtime_bytes=4.5e7,
        matmul_concurrent={1: 5e10, 4: 2.5e10},
        step_slowdown={2: 1.1, 4: 2.4},
        sync_wait_s={2: 6e-4, 4: 1.1e-3},
        step_skew={2: 0.03, 4: 0.07},
        dtensor_clip_call_s={2: 1.9e-3, 4: 2.8e-3},
        step_costs={"adamw": (2e-5, 3e-10), "check": (4e-6, 1e-11), "dtensor adamw": (1e-4, 0)},
        op_s=6e-6,
        fsdp_unit_s={2: 6e-4, 3: 7e-4},
        fsdp_tensor_s={2: 4e-5, 3: 5e-5},
        fsdp_in_step={2: Curve(((1e3, 1e-3), (8e5, 3e-3)))},
        tp_module_s=4.7e-4,
        tp_in_step={2: Curve(((1.6e4, 1.7e-3), (2**20, 2.3e-3)))},
        reduce_in_step={2: 4e-4, 4: 1.7e-3},
        loop_step_s=3e-4,
        loop_microbatch_s=2e-4,
        pipe_action_s={"gpipe": 2e-4, "1f1b": 8e-5},
        pipe_flush_s={"gpipe": 0.0, "1f1b": 3e-4},
        ps_exchange_s={"sync": {1: 2e-3, 2: 8e-3}, "async": {1: 3e-3}},
        spread={"matmul fp32 512": 0.04, "training loop": 0.1},
        gemm_by_size={32: 6e10, 512: 9e10},
        attention_rates={(32, 32): (3.6e10, 2.9e10), (128, 32): (5.7e10, 5.1e10)},
        elementwise_s={"aten.gelu": 5e-10},
        speed={"matmul fp32": 1.6e11, "matmul half": 1.1e12, "operator": 940.0, "copy": 1.1e10},
    )


def test_round_trip(tmp_path: Path) -> None:
    path = save_profile(_profile(), tmp_path / "p.json", {"cpu": "x"})
    assert load_profile(path) == _profile()


def test_fingerprint_changes_with_any_fact() -> None:
    base = {"cpu": "EPYC", "cores": "2", "gpu": "none", "torch": "2.13.0"}
    assert fingerprint(base) == fingerprint(dict(base))
    assert fingerprint(base) != fingerprint({**base, "torch": "2.14.0"})


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("POLYTRAIN_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    assert profile_path("f00") == tmp_path / "host-f00.json"


def test_missing_and_malformed_files_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="run `polytrain calibrate` first"):
        load_profile(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": 1, "device": "cpu"}')
    with pytest.raises(PlanError, match="--force"):
        load_profile(bad)
    bad.write_text("not json")
    with pytest.raises(PlanError, match="not a polytrain profile"):
        load_profile(bad)


def test_a_profile_saved_before_step_costs_loads_without_them(tmp_path: Path) -> None:
    path = save_profile(_profile(), tmp_path / "p.json")
    data = json.loads(path.read_text())
    del data["step_costs"], data["op_s"], data["fsdp_unit_s"]  # as written before them
    del data["loop_step_s"], data["loop_microbatch_s"], data["spread"], data["tp_module_s"]
    del data["ps_exchange_s"], data["pipe_action_s"], data["pipe_flush_s"]
    del data["gemm_by_size"], data["attention_rates"], data["elementwise_s"]
    path.write_text(json.dumps(data))
    old = load_profile(path)
    assert old.tp_module_s == 0.0  # [Note: DTensor module overhead] unpriced
    assert old.step_costs == {} and old.op_s == 0.0 and old.fsdp_unit_s == {}
    assert old.loop_step_s == old.loop_microbatch_s == 0.0 and old.spread == {}
    assert old.ps_exchange_s == {}
    assert old.pipe_action_s == old.pipe_flush_s == {}  # [Note: pipeline runtime overhead]
    assert old.gemm_by_size == {} and old.attention_rates == {}  # [Note: attention kernels]
    assert old.elementwise_s == {}  # [Note: elementwise kernels]
    assert old.matmul_concurrent == _profile().matmul_concurrent


def test_repeated_calibrations_keep_each_figures_median() -> None:
    """[Note: repeated calibrations]: every number at its median over the profiles (curves
    point by point, mappings key by key over the profiles that have the key), the rest from
    the first; one profile is itself."""
    base = _profile()
    slow = replace(
        base,
        op_s=12e-6,
        collectives={"all_reduce": {2: Curve(((4096.0, 3e-4), (2**20, 1e-3)))}},
        step_slowdown={2: 1.5},
        pipe_action_s={"gpipe": 4e-4, "1f1b": 8e-5, "pipedream": 1e-4},
    )
    fast = replace(base, op_s=2e-6, device="cpu (other)", step_slowdown={2: 1.0, 4: 2.0})
    median = median_profile([slow, base, fast])
    assert median.op_s == pytest.approx(6e-6)  # base's
    assert median.collectives["all_reduce"][2].points == ((4096.0, 1e-4), (2**20, 2e-3))
    assert median.step_slowdown == {2: 1.1, 4: pytest.approx(2.2)}  # 4: base's and fast's
    assert median.pipe_action_s["gpipe"] == 2e-4 and median.pipe_action_s["pipedream"] == 1e-4
    assert median.matmul_flops == base.matmul_flops and median.device == "cpu"
    assert median_profile([slow]) is slow
    with pytest.raises(ValueError, match="at least one"):
        median_profile([])

"""Saved host profiles: JSON files in a cache directory, keyed by a hardware fingerprint.

A profile is reused until the fingerprint (CPU model, cores, accelerator, torch version) changes;
nothing is unpickled, a file that does not parse is a `PlanError` naming it and the fix.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polytrain.errors import PlanError
from polytrain.planner.types import Curve, HostProfile

__all__ = [
    "cache_dir",
    "fingerprint",
    "load_profile",
    "median_profile",
    "profile_from_dict",
    "profile_path",
    "profile_to_dict",
    "save_profile",
]

FORMAT = 1


def cache_dir() -> Path:
    """``$POLYTRAIN_CACHE``, else ``$XDG_CACHE_HOME/polytrain``, else ``~/.cache/polytrain``."""
    if env := os.environ.get("POLYTRAIN_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "polytrain"


def fingerprint(identity: dict[str, str]) -> str:
    """A short stable hash of what the measurements depend on (hardware and torch)."""
    text = json.dumps(identity, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def profile_path(fp: str, directory: Path | None = None) -> Path:
    return (directory or cache_dir()) / f"host-{fp}.json"


def profile_to_dict(profile: HostProfile, identity: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "identity": identity or {},
        "fingerprint": profile.fingerprint,
        "device": profile.device,
        "matmul_flops": profile.matmul_flops,
        "matmul_by_size": {
            dtype: {str(n): v for n, v in sizes.items()}
            for dtype, sizes in profile.matmul_by_size.items()
        },
        "mem_bw": profile.mem_bw,
        "collectives": {
            op: {str(world): [list(p) for p in curve.points] for world, curve in by_world.items()}
            for op, by_world in profile.collectives.items()
        },
        "startup_s": profile.startup_s,
        "baseline_bytes": profile.baseline_bytes,
        "runtime_bytes": profile.runtime_bytes,
        "threads": profile.threads,
        "matmul_concurrent": {str(n): v for n, v in profile.matmul_concurrent.items()},
        "step_slowdown": {str(n): v for n, v in profile.step_slowdown.items()},
        "sync_wait_s": {str(n): v for n, v in profile.sync_wait_s.items()},
        "step_skew": {str(n): v for n, v in profile.step_skew.items()},
        "dtensor_clip_call_s": {str(n): v for n, v in profile.dtensor_clip_call_s.items()},
        "step_costs": {part: list(pair) for part, pair in profile.step_costs.items()},
        "op_s": profile.op_s,
        "fsdp_unit_s": {str(k): v for k, v in profile.fsdp_unit_s.items()},
        "fsdp_tensor_s": {str(k): v for k, v in profile.fsdp_tensor_s.items()},
        "fsdp_in_step": {
            str(k): [list(pt) for pt in curve.points] for k, curve in profile.fsdp_in_step.items()
        },
        "tp_module_s": profile.tp_module_s,
        "tp_in_step": {
            str(k): [list(pt) for pt in curve.points] for k, curve in profile.tp_in_step.items()
        },
        "reduce_in_step": {str(n): v for n, v in profile.reduce_in_step.items()},
        "loop_step_s": profile.loop_step_s,
        "loop_microbatch_s": profile.loop_microbatch_s,
        "pipe_action_s": profile.pipe_action_s,
        "pipe_flush_s": profile.pipe_flush_s,
        "ps_exchange_s": {
            mode: {str(n): v for n, v in by_n.items()}
            for mode, by_n in profile.ps_exchange_s.items()
        },
        "spread": profile.spread,
        "gemm_by_size": {str(n): v for n, v in profile.gemm_by_size.items()},
        "attention_rates": {
            f"{t},{d}": list(pair) for (t, d), pair in profile.attention_rates.items()
        },
        "elementwise_s": profile.elementwise_s,
        "speed": profile.speed,
    }


def profile_from_dict(data: dict[str, Any]) -> HostProfile:
    """The inverse of `profile_to_dict` (a `KeyError`/`TypeError` on a malformed dict)."""
    return HostProfile(
        fingerprint=str(data["fingerprint"]),
        device=str(data["device"]),
        matmul_flops={k: float(v) for k, v in data["matmul_flops"].items()},
        matmul_by_size={
            dtype: {int(n): float(v) for n, v in sizes.items()}
            for dtype, sizes in data.get("matmul_by_size", {}).items()
        },
        mem_bw=float(data["mem_bw"]),
        collectives={
            op: {
                int(world): Curve(tuple((float(b), float(s)) for b, s in points))
                for world, points in by_world.items()
            }
            for op, by_world in data.get("collectives", {}).items()
        },
        startup_s=float(data.get("startup_s", 0.0)),
        baseline_bytes=float(data.get("baseline_bytes", 0.0)),
        runtime_bytes=float(data.get("runtime_bytes", 0.0)),  # older profiles: unknown
        threads=int(data.get("threads", 1)),
        matmul_concurrent={int(n): float(v) for n, v in data.get("matmul_concurrent", {}).items()},
        # older profiles: the slowdown from the matmul rates
        step_slowdown={int(n): float(v) for n, v in data.get("step_slowdown", {}).items()},
        # older profiles: the share alone ([Note: ranks' skew])
        sync_wait_s={int(n): float(v) for n, v in data.get("sync_wait_s", {}).items()},
        step_skew={int(n): float(v) for n, v in data.get("step_skew", {}).items()},
        dtensor_clip_call_s={
            int(n): float(v) for n, v in data.get("dtensor_clip_call_s", {}).items()
        },
        # absent in profiles saved before the per-step costs were calibrated: {} makes the
        # cost model use its memory-bound update (`Env.optimizer_s`), as it did then
        step_costs={
            str(part): (float(pair[0]), float(pair[1]))
            for part, pair in data.get("step_costs", {}).items()
        },
        op_s=float(data.get("op_s", 0.0)),  # older profiles: no operator overhead
        fsdp_unit_s={int(k): float(v) for k, v in data.get("fsdp_unit_s", {}).items()},
        fsdp_tensor_s={int(k): float(v) for k, v in data.get("fsdp_tensor_s", {}).items()},
        fsdp_in_step={  # older profiles: FSDP2's collectives at the isolated curves
            int(k): Curve(tuple(sorted((float(b), float(t)) for b, t in pts)))
            for k, pts in data.get("fsdp_in_step", {}).items()
        },
        tp_module_s=float(data.get("tp_module_s", 0.0)),  # older profiles: unpriced
        tp_in_step={  # older profiles: tensor parallelism's collectives at the isolated curves
            int(k): Curve(tuple(sorted((float(b), float(t)) for b, t in pts)))
            for k, pts in data.get("tp_in_step", {}).items()
        },
        # older profiles: the end of step's reductions at the isolated curves
        reduce_in_step={int(n): float(v) for n, v in data.get("reduce_in_step", {}).items()},
        # older profiles: the loop's own Python unpriced, no spreads recorded
        loop_step_s=float(data.get("loop_step_s", 0.0)),
        loop_microbatch_s=float(data.get("loop_microbatch_s", 0.0)),
        # older profiles: the pipeline runtime's own Python and waits unpriced
        pipe_action_s={k: float(v) for k, v in data.get("pipe_action_s", {}).items()},
        pipe_flush_s={k: float(v) for k, v in data.get("pipe_flush_s", {}).items()},
        # older profiles: the parameter server's fixed exchange unpriced (the link's latency)
        ps_exchange_s={
            str(mode): {int(n): float(v) for n, v in by_n.items()}
            for mode, by_n in data.get("ps_exchange_s", {}).items()
        },
        spread={str(k): float(v) for k, v in data.get("spread", {}).items()},
        # older profiles: Linears at the square-matmul rates, attention at the matmul rate
        gemm_by_size={int(n): float(v) for n, v in data.get("gemm_by_size", {}).items()},
        attention_rates={
            _length_and_head(key): (float(pair[0]), float(pair[1]))
            for key, pair in data.get("attention_rates", {}).items()
        },
        elementwise_s={str(k): float(v) for k, v in data.get("elementwise_s", {}).items()},
        # older profiles: no speed figures (`planner.drift` cannot rescale them)
        speed={str(k): float(v) for k, v in data.get("speed", {}).items()},
    )


# [Note: repeated calibrations]
# On a host that others share, one calibration samples a minute or two of its speed, and the
# figures of calibrations a few minutes apart disagree: three in a row on the 2-core VM
# (2026-11-26 evening, `benchmarks/planner/repeat.py`, ~2 min each) read the operator call at
# 5.3-9.3 us, AdamW's per-tensor cost at 25-40 us, the 16-byte all-reduce at 1.4-2.4 ms and the
# fp32 matmul at 122-146 GFLOP/s, and the predictions they gave for the benchmark's 14 layouts
# moved by a median 20% (gpt tiny) and 19% (mlp tiny) from the lowest to the highest, as much as
# the error the benchmark measures. `polytrain calibrate` therefore measures `repeats` times
# (`CalibrationPlan.repeats`) and keeps every figure's median over them: `median_profile`, on
# the saved JSON form, number by number (curves point by point), so a figure the profile gains
# later is combined without code here.


def median_profile(profiles: Sequence[HostProfile]) -> HostProfile:
    """[Note: repeated calibrations] Every figure of ``profiles`` (measured with the same plan
    on the same host) at its median over them; the rest (identity, device) from the first."""
    if not profiles:
        raise ValueError("median_profile needs at least one profile")
    if len(profiles) == 1:
        return profiles[0]
    return profile_from_dict(_median([profile_to_dict(p) for p in profiles]))


def _median(values: list[Any]) -> Any:
    """The median of ``values`` (same-shaped JSON trees): numbers by their median, mappings key
    by key over those that have the key, lists of one length item by item, anything else the
    first's."""
    first = values[0]
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return statistics.median(values)
    if all(isinstance(v, dict) for v in values):
        keys = dict.fromkeys(k for v in values for k in v)
        return {k: _median([v[k] for v in values if k in v]) for k in keys}
    if all(isinstance(v, list) and len(v) == len(first) for v in values):
        return [_median(list(items)) for items in zip(*values, strict=True)]
    return first


def _length_and_head(key: str) -> tuple[int, int]:
    t, d = key.split(",")
    return int(t), int(d)


def save_profile(profile: HostProfile, path: Path, identity: dict[str, str] | None = None) -> Path:
    """Write ``profile`` as JSON (to a temporary name first, so a crash leaves no half file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(profile_to_dict(profile, identity), indent=1, sort_keys=True))
    tmp.replace(path)
    return path


def load_profile(path: Path) -> HostProfile:
    """A saved profile; a missing or malformed file is a `PlanError` that says what to do."""
    try:
        data = json.loads(Path(path).read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
        return profile_from_dict(data)
    except FileNotFoundError:
        raise PlanError(
            f"host profile {str(path)!r} does not exist: run `polytrain calibrate` first"
        ) from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PlanError(
            f"host profile {str(path)!r} is not a polytrain profile ({exc}): run "
            "`polytrain calibrate --force` to measure again"
        ) from None

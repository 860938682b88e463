"""``polytrain train --pp 2 ... --trace`` then ``polytrain timeline``, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from polytrain.pipeline.schedule import zbv
from polytrain.testing import scaled
from tests.integration.test_cli import ROOT, polytrain

pytestmark = pytest.mark.slow


def test_trace_then_timeline(tmp_path: Path) -> None:
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    args = ["train", "--model", "mlp", "--nproc", "2", "--pp", "2", "--schedule", "1f1b"]
    args += ["--microbatches", "4", "--steps", "3", "--eval-every", "2", "--no-progress"]
    run = polytrain(*args, "--trace", str(trace), "--out-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    for rank in (0, 1):
        for kind in ("F", "B"):
            seen = {
                (e["args"]["step"], e["args"]["microbatch"])
                for e in events
                if e["pid"] == rank and e["name"] == kind
            }
            assert seen == {(t, i) for t in range(3) for i in range(4)}, (rank, kind)
        assert {
            e["args"]["stage"] for e in events if e["pid"] == rank and "stage" in e["args"]
        } == {rank}
    assert any(e["name"] == "SEND_F" and e["pid"] == 0 for e in events)
    assert any(e["name"] == "RECV_B" and e["pid"] == 0 for e in events)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert metrics[-1]["strategy"] == "1f1b-pp2-m4" and "val_loss" in metrics[-1]

    drawn = polytrain("timeline", str(trace), "--png", str(png), cwd=tmp_path)
    assert drawn.returncode == 0, drawn.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"
    again = polytrain("timeline", str(trace), "--png", str(png), cwd=tmp_path)
    assert again.returncode == 2 and "already exists" in again.stderr


def test_zbv_runs_its_schedule(tmp_path: Path) -> None:
    """``--schedule zbv``: every rank runs its two stages' F, I and W in the schedule's order
    (read back from the trace), W after its I, no full B; the timeline draws it."""
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    args = ["train", "--model", "mlp", "--nproc", "2", "--pp", "2", "--schedule", "zbv"]
    args += ["--microbatches", "4", "--steps", "2", "--eval-every", "0", "--no-progress"]
    run = polytrain(*args, "--trace", str(trace), "--out-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    compute = sorted(
        (e for e in events if e["name"] in ("F", "B", "I", "W")), key=lambda e: e["ts"]
    )
    program = zbv(2, 4)
    for rank in (0, 1):
        for step in (0, 1):
            ran = [
                f"{e['args']['stage']}{e['name']}{e['args']['microbatch']}"
                for e in compute
                if e["pid"] == rank and e["args"]["step"] == step
            ]
            assert ran == [str(a) for a in program[rank]], (rank, step)
    ends = {
        (e["pid"], e["args"]["step"], e["args"]["stage"], e["args"]["microbatch"]): e
        for e in compute
        if e["name"] == "I"
    }
    for w in (e for e in compute if e["name"] == "W"):
        i = ends[(w["pid"], w["args"]["step"], w["args"]["stage"], w["args"]["microbatch"])]
        assert w["ts"] >= i["ts"] + i["dur"]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert metrics[-1]["strategy"] == "zbv-pp2-m4"

    drawn = polytrain("timeline", str(trace), "--png", str(png), cwd=tmp_path)
    assert drawn.returncode == 0, drawn.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"


GPT_TINY = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=16"]


def test_zero_inside_stages_from_the_cli(tmp_path: Path) -> None:
    """``polytrain train --dp 2 --pp 2 --zero 3`` trains the sharded stages (docs/pipeline.md,
    ZeRO inside stages)."""
    args = ["train", "--model", "gpt", "--nproc", "4", "--dp", "2", "--pp", "2", "--zero", "3"]
    args += ["--schedule", "1f1b", "--microbatches", "2", "--steps", "2", "--batch-size", "8"]
    args += ["--eval-every", "0", "--no-progress", "--out-dir", str(tmp_path / "cli")]
    for field in GPT_TINY:
        args += ["--set", field]
    run = polytrain(*args, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    metrics = [json.loads(line) for line in (tmp_path / "cli" / "metrics.jsonl").open()]
    assert metrics[-1]["strategy"] == "1f1b-pp2-m2-dp2-zero3"


def test_zero_inside_stages_from_the_python_api(tmp_path: Path) -> None:
    """``polytrain.run`` of a job with ``parallel.zero = 2``, ``dp = 2`` and ``pp = 2``."""
    script = tmp_path / "api.py"
    model = ", ".join(f"model__{f.split('=')[0][6:]}={f.split('=')[1]}" for f in GPT_TINY)
    script.write_text(
        "import polytrain\n"
        f"job = polytrain.load(model__name='gpt', {model}, parallel__dp=2, parallel__pp=2,\n"
        "    parallel__zero=2, pipeline__schedule='gpipe', pipeline__microbatches=2,\n"
        "    train__steps=2, train__global_batch_size=8, train__eval_every=0,\n"
        f"    launch__nproc=4, observe__progress=False, observe__out_dir={str(tmp_path / 'api')!r})\n"
        "print(polytrain.run(job))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(240),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    metrics = [json.loads(line) for line in (tmp_path / "api" / "metrics.jsonl").open()]
    assert metrics[-1]["strategy"] == "gpipe-pp2-m2-dp2-zero2"

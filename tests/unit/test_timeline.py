"""`polytrain timeline`: draws a pipeline step, measures its bubble, never overwrites."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polytrain.cli.app import main
from polytrain.errors import ConfigError
from polytrain.observe.timeline import measured_bubble, render_timeline, step_events


def _event(name: str, rank: int, start: float, dur: float, mb: int, step: int = 0) -> dict:
    args = {"microbatch": mb, "stage": rank, "step": step}
    return {"name": name, "ph": "X", "pid": rank, "tid": 0, "ts": start, "dur": dur, "args": args}


def gpipe_trace(p: int, m: int, step: int = 0) -> list[dict]:
    """GPipe with F = B = 1 time unit (1000 us), as `schedule.render` draws it."""
    events = []
    for s in range(p):
        for i in range(m):
            events.append(_event("F", s, (s + i) * 1000.0, 1000.0, i, step))
            events.append(_event("B", s, (2 * (m + p - 1) - 1 - s - i) * 1000.0, 1000.0, i, step))
    return events


def test_measured_bubble_of_an_ideal_gpipe_is_the_formula() -> None:
    for p, m in [(2, 1), (2, 4), (4, 8)]:
        assert measured_bubble(gpipe_trace(p, m)) == pytest.approx((p - 1) / (m + p - 1))


def test_last_step_is_drawn_by_default(tmp_path: Path) -> None:
    events = gpipe_trace(2, 2, step=0) + gpipe_trace(2, 2, step=1)
    assert {e["args"]["step"] for e in step_events(events)} == {1}
    with pytest.raises(ConfigError, match="step 5 is not in the trace"):
        step_events(events, 5)


def test_cli_writes_png_and_refuses_to_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": gpipe_trace(4, 4)}))
    png = tmp_path / "out.png"
    with pytest.raises(SystemExit) as exc:
        main(["timeline", str(trace), "--png", str(png)])
    assert exc.value.code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    before = png.read_bytes()
    with pytest.raises(SystemExit) as exc:
        main(["timeline", str(trace), "--png", str(png)])
    assert exc.value.code == 2
    assert "already exists" in capsys.readouterr().err
    assert png.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left


def test_bad_traces_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        render_timeline(tmp_path / "missing.json", tmp_path / "a.png")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="is not JSON"):
        render_timeline(bad, tmp_path / "a.png")
    spmd = tmp_path / "spmd.json"
    spmd.write_text(
        json.dumps(
            {
                "traceEvents": [
                    {"name": "forward", "ph": "X", "pid": 0, "ts": 0, "dur": 1, "args": {}}
                ]
            }
        )
    )
    with pytest.raises(ConfigError, match="no pipeline spans"):
        render_timeline(spmd, tmp_path / "a.png")
    assert not (tmp_path / "a.png").exists()

"""Pipeline diagrams from Chrome traces: one row per rank, one box per forward and backward
(or backward half: I, the input gradient, and W, the weight gradient, of zero-bubble schedules).

Draws a step of a ``--trace`` file the way GPipe (Huang et al. 2019, figure 2) and PipeDream
(Narayanan et al. SOSP 2019, figure 4) draw schedules: time runs left to right, each rank is a
row, and each forward (F) or backward (B, I, W) is a box labelled with its micro-batch index
(prefixed with its stage, ``2F0``, when a rank holds several stages). Sends
and receives are thin bars above the boxes; the optimizer and all-reduces are grey.

`measured_bubble` is the same picture as a number: the fraction of ``ranks x window`` in which
no forward or backward runs, to compare with the ideal ``(p - 1) / (m + p - 1)`` (1F1B).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polytrain.errors import ConfigError

__all__ = ["load_trace", "measured_bubble", "render_timeline", "step_events"]

COMPUTE = ("F", "B", "I", "W")
COLORS = {
    "F": "#4c72b0",
    "B": "#55a868",
    "I": "#55a868",
    "W": "#937860",
    "optimizer": "#8c8c8c",
    "allreduce_grads": "#c44e52",
}
COMM_COLORS = {"SEND_F": "#dd8452", "RECV_F": "#f2c6a0", "SEND_B": "#8172b3", "RECV_B": "#c5bde0"}


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    """The complete ("X") events of a Chrome trace file; `ConfigError` if it is not one."""
    trace = Path(path)
    if not trace.is_file():
        raise ConfigError(f"trace {str(trace)!r} does not exist: pass a file written by --trace")
    try:
        data = json.loads(trace.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"trace {str(trace)!r} is not JSON ({exc}): pass a --trace file"
        ) from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ConfigError(f"trace {str(trace)!r} has no traceEvents list: pass a --trace file")
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]


def step_events(events: Sequence[dict[str, Any]], step: int | None = None) -> list[dict[str, Any]]:
    """Pipeline events (those with a ``stage``) of ``step``; the last traced step when None."""
    pipeline = [e for e in events if "stage" in e.get("args", {}) and "step" in e["args"]]
    if not pipeline:
        raise ConfigError(
            "the trace has no pipeline spans: record one with --pp 2 (or more) and --trace PATH"
        )
    steps = sorted({int(e["args"]["step"]) for e in pipeline})
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        raise ConfigError(
            f"step {step} is not in the trace: it holds steps {steps[0]}..{steps[-1]}"
        )
    return [e for e in pipeline if int(e["args"]["step"]) == chosen]


def measured_bubble(events: Sequence[dict[str, Any]]) -> float:
    """Idle fraction of ``ranks x window``: time with no F, B, I or W running, over the events'
    span."""
    compute = [e for e in events if e["name"] in COMPUTE]
    if not compute:
        return 0.0
    start = min(e["ts"] for e in compute)
    end = max(e["ts"] + e["dur"] for e in compute)
    ranks = {e["pid"] for e in compute}
    busy = sum(e["dur"] for e in compute)
    return 1.0 - busy / (len(ranks) * (end - start))


def render_timeline(trace: str | Path, png: str | Path, step: int | None = None) -> Path:
    """Draw one step of ``trace`` to ``png``; never overwrites an existing file."""
    out = Path(png)
    if out.exists():
        raise ConfigError(f"--png {str(out)!r} already exists: choose another path or remove it")
    events = step_events(load_trace(trace), step)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted({int(e["pid"]) for e in events})
    t0 = min(e["ts"] for e in events)
    stages_of: dict[int, set[int]] = {}
    for e in events:
        stages_of.setdefault(int(e["pid"]), set()).add(int(e["args"]["stage"]))
    width = max(e["ts"] + e["dur"] for e in events) - t0
    fig, ax = plt.subplots(figsize=(12, 0.8 + 0.7 * len(ranks)))
    for e in events:
        row = ranks.index(int(e["pid"]))
        x, w = (e["ts"] - t0) / 1e3, e["dur"] / 1e3
        name = str(e["name"])
        if name in COMM_COLORS:
            ax.broken_barh([(x, w)], (row - 0.42, 0.1), facecolors=COMM_COLORS[name])
            continue
        ax.broken_barh(
            [(x, w)], (row - 0.3, 0.6), facecolors=COLORS.get(name, "#cccccc"), edgecolor="black"
        )
        if name in COMPUTE and w > width / 1e3 / 150:
            label = f"{name}{e['args'].get('microbatch', '')}"
            if len(stages_of[int(e["pid"])]) > 1:
                label = f"{e['args']['stage']}{label}"
            ax.text(x + w / 2, row, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels(
        [
            f"rank {r} (stage{'s' if len(stages_of[r]) > 1 else ''} "
            f"{', '.join(map(str, sorted(stages_of[r])))})"
            for r in ranks
        ]
    )
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    chosen = int(events[0]["args"]["step"])
    ax.set_title(
        f"step {chosen}: measured bubble {measured_bubble(events):.1%} "
        "(F blue, B and I green, W brown, sends/receives thin bars, optimizer grey)"
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=120)
        try:
            os.link(tmp, out)  # atomic, and fails rather than replace a file made meanwhile
        except FileExistsError:
            raise ConfigError(
                f"--png {str(out)!r} already exists: choose another path or remove it"
            ) from None
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return out

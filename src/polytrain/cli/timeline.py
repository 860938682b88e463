"""``polytrain timeline TRACE.json --png OUT.png``: draw a pipeline step from a --trace file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["timeline_command"]


def timeline_command(
    trace: Annotated[Path, typer.Argument(help="Chrome trace written by train --trace")],
    png: Annotated[Path, typer.Option(help="PNG to write (never overwritten)")],
    step: Annotated[int | None, typer.Option(help="step to draw (default: the last)")] = None,
) -> None:
    """Draw one training step of a pipeline trace: a row per rank, a box per F and B."""
    from polytrain.observe.timeline import render_timeline

    out = render_timeline(trace, png, step)
    typer.echo(f"polytrain: timeline written to {out}")

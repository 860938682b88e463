"""``polytrain sched ...``: the cluster scheduler's commands, one typer sub-app (issue 40)."""

from __future__ import annotations

import typer

from polytrain.cli.sched_slurm import slurm_script_command

__all__ = ["sched_app"]

sched_app = typer.Typer(
    help="Share a cluster between training jobs; or write a Slurm script for one job.",
    no_args_is_help=True,
)
sched_app.command("slurm-script")(slurm_script_command)

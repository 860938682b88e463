"""``polytrain sched``: sharing devices between training jobs in time slices (issue 40).

The local executor's commands live in `polytrain.cli.sched_local`; this module only gathers
them on the ``sched`` sub-application.
"""

from __future__ import annotations

import typer

from polytrain.cli.sched_local import (
    cancel_command,
    logs_command,
    serve_command,
    status_command,
    submit_command,
)

__all__ = ["sched_app"]

sched_app = typer.Typer(
    name="sched",
    help="Schedule training jobs on this host's devices: serve, submit, status, cancel, logs.",
    no_args_is_help=True,
)
sched_app.command("serve")(serve_command)
sched_app.command("submit")(submit_command)
sched_app.command("status")(status_command)
sched_app.command("cancel")(cancel_command)
sched_app.command("logs")(logs_command)

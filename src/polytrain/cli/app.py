"""``polytrain``: the typer application and its error handling (contract 6).

A user mistake (bad flag, bad value, missing file) prints one line ``polytrain: error: ...`` and
exits with code 2; a failed worker prints one line naming its rank and exits with 1 (2 when the
worker's error was itself a user mistake).
"""

from __future__ import annotations

import os
import sys

import typer

try:  # typer >= 0.20 vendors click; older releases use the click package itself
    from typer._click import exceptions as cx
except ImportError:  # pragma: no cover
    import click.exceptions as cx  # type: ignore[no-redef]

from polytrain.cli.calibrate import calibrate_command
from polytrain.cli.doctor import doctor
from polytrain.cli.hogwild import hogwild_command
from polytrain.cli.plan import plan_command
from polytrain.cli.sched import sched_app
from polytrain.cli.timeline import timeline_command
from polytrain.cli.train import train_command
from polytrain.errors import PolytrainError
from polytrain.launch.local import Interrupted, WorkerFailure

__all__ = ["app", "main"]

app = typer.Typer(
    name="polytrain",
    help="Train a PyTorch model under any parallel strategy from one job description.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.command("train")(train_command)
app.command("doctor")(doctor)
app.command("hogwild")(hogwild_command)
app.command("timeline")(timeline_command)
app.command("plan")(plan_command)
app.command("calibrate")(calibrate_command)
app.add_typer(sched_app, name="sched")


def _subclasses(cls: type) -> list[type]:
    out = [cls]
    children: list[type] = cls.__subclasses__()
    for child in children:
        out += _subclasses(child)
    return out


_USER_ERRORS = {cls.__name__ for cls in _subclasses(PolytrainError)}


def _fail(message: str, code: int, *, now: bool = False) -> None:
    print(f"polytrain: error: {message}", file=sys.stderr)
    if now:
        # After a failed or interrupted run the workers are already ended and the run-directory
        # lock released; the interpreter's own teardown (torch's stores and agent threads) took
        # 7-28 s more on a loaded machine, during which the command did not return.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv, prog_name="polytrain", standalone_mode=False)
    except cx.NoArgsIsHelpError:
        # typer has printed the help already (rich), before raising
        sys.stdout.flush()
        sys.exit(2)
    except cx.UsageError as exc:
        _fail(exc.format_message().replace("\n", " "), 2)
    except (typer.Abort, KeyboardInterrupt):
        _fail("interrupted", 130)
    except Interrupted as exc:  # a signal during the run: which checkpoint is left
        _fail(str(exc), 130, now=True)
    except PolytrainError as exc:
        _fail(str(exc).splitlines()[0], 2)
    except WorkerFailure as exc:
        code = 2 if exc.exc_type in _USER_ERRORS else 1
        _fail(f"{exc} (all worker logs: {exc.log_dir})", code, now=True)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()

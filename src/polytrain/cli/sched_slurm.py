"""``polytrain sched slurm-script JOB.toml``: the sbatch script of one job, for Slurm users.

For users who only want a job script: no scheduler state, no policy. The job file is validated
with the trainer's own loader first (a mistake is one line and exit 2, before any script
exists); the script runs one ``polytrain train`` launcher per node through ``srun``
(`polytrain.scheduler.slurm_script`). ``--out`` never overwrites an existing file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from polytrain.config import job_from_dict, load_job
from polytrain.errors import ConfigError
from polytrain.scheduler.slurm_script import ScriptSpec, batch_script

__all__ = ["slurm_script_command"]


def slurm_script_command(
    job: Annotated[Path, typer.Argument(help="TOML job file (validated first)")],
    nodes: Annotated[
        int | None, typer.Option(help="nodes to allocate (default: the job's launch.nnodes)")
    ] = None,
    nproc_per_node: Annotated[
        int | None,
        typer.Option(help="workers (device slots) per node (default: the job's launch.nproc)"),
    ] = None,
    partition: Annotated[str, typer.Option(help="Slurm partition ('' = the default)")] = "",
    out: Annotated[
        Path | None, typer.Option(help="write the script here (never overwritten); else print")
    ] = None,
    signal: Annotated[str, typer.Option(help="sbatch --signal, e.g. TERM@60 ('' = none)")] = "",
    python: Annotated[str, typer.Option(help="Python interpreter on the nodes")] = "python3",
) -> None:
    """Print (or write) an sbatch script that trains JOB.toml across a Slurm allocation."""
    if out is not None and (out.exists() or out.is_symlink()):
        raise ConfigError(f"--out {str(out)!r} already exists: choose another path or remove it")
    data = load_job(job)
    built = job_from_dict(data)  # the trainer's own validation: a bad file fails here
    device = str(data.get("train", {}).get("device", "auto"))
    spec = ScriptSpec(
        job_name=f"polytrain-{job.stem}".replace(" ", "_"),
        config=job.resolve(),
        nodes=built.launch.nnodes if nodes is None else nodes,
        nproc_per_node=built.launch.num_procs if nproc_per_node is None else nproc_per_node,
        output="polytrain-%j.out",
        run_dir=built.observe.out_dir or "runs/slurm-%j",
        partition=partition or None,
        python=python,
        signal=signal or None,
        gpus_per_node=device == "cuda",
    )
    script = batch_script(spec)
    if out is None:
        typer.echo(script, nl=False)
        return
    try:
        with out.open("x") as f:  # "x": a file created meanwhile is not overwritten either
            f.write(script)
    except OSError as exc:
        raise ConfigError(f"--out {str(out)!r}: cannot write ({exc.strerror})") from None
    out.chmod(0o755)
    typer.echo(f"polytrain: Slurm script written to {out} (submit: sbatch {out})")

"""The sbatch script that runs one ``polytrain train`` across a Slurm allocation's nodes.

Shape (as torchtitan's ``multinode_trainer.slurm``): one Slurm task per node, each task one
``polytrain train`` launcher that starts ``nproc_per_node`` workers; the launchers meet through
torch's rendezvous at the first node's address, each passing its own ``--node-rank``
(``$SLURM_NODEID``). Pure text: no Slurm and no torch needed to build or test it.

[Note: one task per node] A device slot is one CPU on a CPU cluster, so a node running K
slots is allocated ``--ntasks-per-node=1 --cpus-per-task=K`` rather than K one-CPU tasks: the
launcher is one process that forks K workers, and under ``task/cgroup`` a one-CPU task would
confine all K workers to one CPU. Slurm reserves the same K CPUs either way.

[Note: per-node expansion] ``$SLURM_NODEID`` differs per task, so it must be expanded by a shell
that ``srun`` starts on each node, not by the batch shell (which runs on node 0 only). The
train command is passed to ``bash -c`` as positional arguments (quoted once, here); only the
node rank, the node count, the endpoint and the node's run directory are expanded there.

[Note: rendezvous port] Jobs can share a host (and on a one-host test cluster every node is
127.0.0.1), and polytrain's launcher joins an existing store on its endpoint when the port is
taken (several nodes of one job on one machine). Two jobs on one port would therefore meet in
one rendezvous; the port is derived from the job id, ``20000 + SLURM_JOB_ID % 9000``, so that
concurrent jobs never share one (unless their ids differ by a multiple of 9000). The range
20000-28999 stays below torch's default rendezvous port (29400) and Linux's ephemeral ports
(32768 and up), from which the kernel picks outgoing connections' local ports.

[Note: a run dir per node] Every launcher takes an exclusive lock on its run directory
(``observe.out_dir``), and on a shared file system two nodes given the same directory (or
picking the same default ``runs/<time>``) would collide. Node 0 writes the job's run directory
(``%j`` becomes the Slurm job id), where rank 0's metrics land; node k writes ``node<k>``
inside it.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from polytrain.errors import ConfigError

__all__ = ["ScriptSpec", "batch_script", "train_command"]

PORT_BASE = 20000
PORT_SPAN = 9000


@dataclass(frozen=True)
class ScriptSpec:
    """Everything one generated script says; validated on construction."""

    job_name: str
    config: Path  # the job's TOML, absolute (the batch shell's cwd is the submit directory)
    nodes: int
    nproc_per_node: int
    output: Path | str | None = None  # stdout+stderr of the job (#SBATCH --output; %j = id)
    partition: str | None = None
    nodelist: tuple[str, ...] = ()  # pin the job to these nodes (the policy's placement)
    train_args: tuple[str, ...] = ()  # more `polytrain train` flags (out dir, checkpoints, resume)
    run_dir: Path | str = "runs/slurm-%j"  # node 0's --out-dir ([Note: a run dir per node])
    python: str = "python3"
    exports: Mapping[str, str] = field(default_factory=dict)  # exported before srun
    signal: str | None = None  # e.g. "TERM@60": warn before the time limit
    gpus_per_node: bool = False  # one slot = one GPU (--gpus-per-node) instead of one CPU
    requeue: bool | None = None  # False: --no-requeue; None: the cluster's default

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigError(f"nodes = {self.nodes}: give at least 1 node")
        if self.nproc_per_node < 1:
            raise ConfigError(f"nproc per node = {self.nproc_per_node}: give at least 1")
        if self.nodelist and len(self.nodelist) != self.nodes:
            raise ConfigError(
                f"nodelist {','.join(self.nodelist)} names {len(self.nodelist)} nodes for a "
                f"{self.nodes}-node job: name exactly {self.nodes}"
            )
        if not self.job_name or any(c.isspace() for c in self.job_name):
            raise ConfigError(f"job name {self.job_name!r}: give a name without spaces")
        for key in self.exports:
            if not key.isidentifier():
                raise ConfigError(f"export {key!r} is not a shell variable name")


def train_command(spec: ScriptSpec) -> list[str]:
    """The node-independent part of each launcher's command line (nodes and rank come per node)."""
    return [
        spec.python,
        "-m",
        "polytrain",
        "train",
        "--config",
        str(spec.config),
        "--nproc",
        str(spec.nproc_per_node),
        *spec.train_args,
    ]


# Run by `bash -c` on every node ([Note: per-node expansion]): "$@" is train_command, $rdzv the
# endpoint, $run_dir node 0's run directory ([Note: a run dir per node]).
_PER_NODE = (
    'out="$run_dir"; if [ "$SLURM_NODEID" != 0 ]; then out="$run_dir/node$SLURM_NODEID"; fi; '
    'exec "$@" --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" --rdzv-endpoint "$rdzv" '
    '--out-dir "$out"'
)


def batch_script(spec: ScriptSpec) -> str:
    """The sbatch script for ``spec``: #SBATCH header, rendezvous endpoint, one srun."""
    slot = f"--gpus-per-node={spec.nproc_per_node}" if spec.gpus_per_node else None
    header = [
        f"--job-name={spec.job_name}",
        f"--nodes={spec.nodes}",
        "--ntasks-per-node=1",  # [Note: one task per node]
        f"--cpus-per-task={1 if spec.gpus_per_node else spec.nproc_per_node}",
    ]
    if slot:
        header.append(slot)
    if spec.output is not None:
        header.append(f"--output={spec.output}")
    if spec.partition:
        header.append(f"--partition={spec.partition}")
    if spec.nodelist:
        header.append(f"--nodelist={','.join(spec.nodelist)}")
    if spec.signal:
        header.append(f"--signal={spec.signal}")
    if spec.requeue is not None:
        header.append("--requeue" if spec.requeue else "--no-requeue")
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        "# Generated by polytrain: one `polytrain train` launcher per node (srun), meeting",
        "# through torch's rendezvous at the first node's address.",
        *(f"#SBATCH {h}" for h in header),
        "set -euo pipefail",
        *(f"export {k}={q(v)}" for k, v in sorted(spec.exports.items())),
        # sed, not head: head exits early and, under pipefail, scontrol's SIGPIPE fails the job.
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        "head_addr=$(scontrol show node \"$head_node\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')",
        "# One port per job: concurrent jobs never share a rendezvous store.",
        f'export rdzv="$head_addr:$(({PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN}))"',
        f"run_dir={q(str(spec.run_dir))}",
        'export run_dir="${run_dir//%j/$SLURM_JOB_ID}"',
        'echo "polytrain-slurm: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, rendezvous $rdzv"',
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c {q(_PER_NODE)} polytrain-node \\",
        "    " + " ".join(q(a) for a in train_command(spec)),
    ]
    return "\n".join(lines) + "\n"

"""The Slurm backend: the scheduler's starts and stops as ``sbatch`` and ``scancel``.

The policy keeps deciding (device counts per job) and `place` keeps placing (device indices);
this backend maps a placement onto Slurm nodes, submits a generated script pinned to those
nodes (``--nodelist``), and reads job states back from ``scontrol show job``. Slurm remains the
authority on its machines: a job whose nodes are busy with another user's work waits PENDING.

[Note: device slots on nodes] The cluster's device slots are numbered node by node:
slot ``d`` is on ``nodes[d // slots_per_node]``. A placement runs on the nodes its slots fall
on, with ``nproc`` workers per node; polytrain's launcher starts the same number of workers on
every node, so a placement that puts unequal counts on its nodes is refused with the counts
named (keep device counts multiples of ``slots_per_node``, or at most one node's worth).

[Note: preemption is scancel + a fresh sbatch] The executor waits for a checkpoint newer than
the preemption request, then calls `stop`; later it starts the job again with ``resume=True``
on whatever devices the policy gives, possibly another node count. Slurm's own requeue
(``scontrol requeue``) would restart the *same* script on the same node count, after a
BeginTime hold (~120 s in 22.05) that has to be lifted by hand, and leaves the requeued job
PENDING in Slurm's queue where it competes with the policy's decisions. A resize needs a new
script anyway, so `stop` is ``scancel`` (SIGTERM to the launchers, which stop their workers)
and every start is a new ``sbatch``. `stop` returns only once Slurm reports the job ended:
a resumed start must never overlap the stopped one's last writes to the checkpoint directory.

[Note: no requeue behind the executor's back] Every script is submitted with
``--no-requeue``: a node failure or a preemption by a higher-priority partition then ends the
start (NODE_FAIL, PREEMPTED: reported as a failure) instead of rerunning the same script later,
unseen by the executor, as a first start (``--no-resume``) into a run directory that already
holds a run.

Exit codes (`exit_code`): COMPLETED and FAILED report the script's exit status; a job killed
by a signal reports 128 + signal, as a shell does; other ends (TIMEOUT, NODE_FAIL,
OUT_OF_MEMORY, PREEMPTED by a higher partition, a cancellation nobody here asked for) report
at least 1, so the executor marks them failed. No torch here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from polytrain.errors import ConfigError, PolytrainError
from polytrain.scheduler.backend import Launch
from polytrain.scheduler.slurm_script import ScriptSpec, batch_script

__all__ = [
    "ENDED",
    "SlurmBackend",
    "SlurmError",
    "exit_code",
    "nodes_for",
    "parse_job_records",
]

# Terminal JobState values of Slurm 22.05 (squeue(1) "JOB STATE CODES").
ENDED = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)
_CALL_TIMEOUT_S = 30.0


class SlurmError(PolytrainError):
    """A Slurm command failed: the command and Slurm's own message."""


def nodes_for(
    devices: Sequence[int], nodes: Sequence[str], slots_per_node: int
) -> tuple[tuple[str, ...], int]:
    """(nodes, workers per node) of a placement ([Note: device slots on nodes])."""
    if not devices:
        raise ConfigError("a start needs at least one device slot")
    total = len(nodes) * slots_per_node
    counts: dict[str, int] = {}
    for d in devices:
        if not 0 <= d < total:
            raise ConfigError(
                f"device slot {d} is not on this cluster ({len(nodes)} nodes x "
                f"{slots_per_node} slots = slots 0..{total - 1})"
            )
        node = nodes[d // slots_per_node]
        counts[node] = counts.get(node, 0) + 1
    if len(set(counts.values())) > 1:
        said = ", ".join(f"{n}: {c}" for n, c in counts.items())
        raise ConfigError(
            f"placement {list(devices)} puts unequal worker counts on its nodes ({said}); "
            f"polytrain starts the same count on every node: use device counts that are "
            f"multiples of {slots_per_node} or fit one node"
        )
    return tuple(counts), next(iter(counts.values()))


# Keys are words that may hold ':' and '/' (``AllocNode:Sid``, ``CPUs/Task``, ``ReqB:S:C:T``).
_FIELD = re.compile(r"([\w:/]+)=(.*?)(?=\s+[\w:/]+=|$)")


def parse_job_records(text: str) -> dict[str, dict[str, str]]:
    """``scontrol -o show job`` output (one job per line) -> job id -> {field: value}.

    Values may hold spaces (``Reason=...``, ``Command=`` paths), so a value runs up to the next
    `` Key=``."""
    records: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        fields = dict(_FIELD.findall(line.strip()))
        if "JobId" in fields:
            records[fields["JobId"]] = fields
    return records


def exit_code(record: Mapping[str, str]) -> int | None:
    """The exit code of an ended job record, None while it is pending or running."""
    state = record.get("JobState", "")
    if state not in ENDED:
        return None
    status, _, sig = record.get("ExitCode", "0:0").partition(":")
    code, signal = int(status or 0), int(sig or 0)
    if signal:
        return 128 + signal
    if state == "COMPLETED":
        return code
    return code or 1


class SlurmBackend:
    """`Backend` on a Slurm cluster: one sbatch per start, scancel per stop.

    ``nodes`` are the Slurm node names the scheduler may use, ``slots_per_node`` the device
    slots on each ([Note: device slots on nodes]); ``exports`` are written into every script
    (e.g. ``PYTHONPATH`` of a checkout); ``slurm_conf`` is passed as ``SLURM_CONF`` to every
    Slurm command (None: the environment's, else Slurm's default file)."""

    name = "slurm"

    def __init__(
        self,
        nodes: Sequence[str],
        slots_per_node: int,
        *,
        partition: str | None = None,
        slurm_conf: Path | None = None,
        exports: Mapping[str, str] | None = None,
        python: str = sys.executable,
        gpus: bool = False,
        stop_timeout_s: float = 60.0,
    ) -> None:
        if not nodes or slots_per_node < 1:
            raise ConfigError(
                f"a Slurm backend needs nodes and device slots on them (nodes: {list(nodes)}, "
                f"slots per node: {slots_per_node}): name at least one node and one slot"
            )
        self.nodes, self.slots_per_node = tuple(nodes), slots_per_node
        self.partition, self.python, self.gpus = partition, python, gpus
        self.exports = dict(exports or {})
        self.stop_timeout_s = stop_timeout_s
        self.env = dict(os.environ)
        if slurm_conf is not None:
            self.env["SLURM_CONF"] = str(slurm_conf)
        self._running: dict[str, str] = {}  # scheduler job id -> Slurm job id
        self.submitted: dict[str, list[str]] = {}  # every Slurm job id of each job, in order

    @property
    def devices(self) -> int:
        return len(self.nodes) * self.slots_per_node

    def _run(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        """One Slurm command: an argument list, a timeout, ``SLURM_CONF`` in its environment."""
        try:
            return subprocess.run(
                list(cmd), env=self.env, capture_output=True, text=True, timeout=_CALL_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            raise SlurmError(f"{cmd[0]} did not answer within {_CALL_TIMEOUT_S:g} s") from None
        except FileNotFoundError:
            raise SlurmError(f"{cmd[0]} not found: install Slurm's client commands") from None

    @staticmethod
    def _failed(cmd: tuple[str, ...], done: subprocess.CompletedProcess[str]) -> SlurmError:
        said = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return SlurmError(f"{' '.join(cmd[:2])} failed ({done.returncode}): {said}")

    def _call(self, *cmd: str) -> str:
        done = self._run(*cmd)
        if done.returncode != 0:
            raise self._failed(cmd, done)
        return done.stdout

    def script(self, launch: Launch) -> str:
        """The batch script of one start (the placement, checkpoints, resume, run dir)."""
        nodelist, nproc = nodes_for(launch.devices, self.nodes, self.slots_per_node)
        train_args = (
            *("--checkpoint-dir", str(launch.checkpoint_dir)),
            *("--checkpoint-every", str(launch.checkpoint_every)),
            "--resume" if launch.resume else "--no-resume",
            "--no-progress",
        )
        spec = ScriptSpec(
            job_name=f"polytrain-{launch.job_id}",
            config=launch.config.resolve(),
            nodes=len(nodelist),
            nproc_per_node=nproc,
            output=launch.log.resolve(),
            partition=self.partition,
            nodelist=nodelist,
            train_args=train_args,
            run_dir=launch.run_dir.resolve(),
            python=self.python,
            exports=self.exports,
            gpus_per_node=self.gpus,
            requeue=False,  # [Note: no requeue behind the executor's back]
        )
        return batch_script(spec)

    def start(self, launch: Launch) -> None:
        if launch.job_id in self._running:
            raise ConfigError(f"job {launch.job_id!r} is already running on Slurm")
        launch.log.parent.mkdir(parents=True, exist_ok=True)
        launch.run_dir.parent.mkdir(parents=True, exist_ok=True)
        # Beside the start's log and named after it: a record of this start, never overwritten.
        path = launch.log.with_suffix(".sbatch")
        try:
            with path.open("x") as f:
                f.write(self.script(launch))
        except FileExistsError:
            raise ConfigError(
                f"{path} already exists: each start of {launch.job_id!r} needs its own log path"
            ) from None
        out = self._call("sbatch", "--parsable", str(path))
        slurm_id = out.strip().split(";")[0]  # "<id>[;<cluster>]"
        self._running[launch.job_id] = slurm_id
        self.submitted.setdefault(launch.job_id, []).append(slurm_id)

    def record(self, slurm_id: str) -> dict[str, str] | None:
        """Slurm's record of one job, None once Slurm has forgotten it (after ``MinJobAge``)."""
        cmd = ("scontrol", "-o", "show", "job", slurm_id)
        done = self._run(*cmd)
        if done.returncode != 0:
            if "Invalid job id" in done.stderr:
                return None
            raise self._failed(cmd, done)
        return parse_job_records(done.stdout).get(slurm_id)

    def stop(self, job_id: str) -> None:
        slurm_id = self._running.pop(job_id, None)
        if slurm_id is None:
            raise ConfigError(f"job {job_id!r} is not running on Slurm")
        self._call("scancel", slurm_id)
        deadline = time.monotonic() + self.stop_timeout_s
        while time.monotonic() < deadline:
            # JobState reads COMPLETING while any of the job's processes may still be alive.
            record = self.record(slurm_id)
            if record is None or record.get("JobState") in ENDED:
                return
            time.sleep(0.2)
        raise SlurmError(
            f"Slurm job {slurm_id} ({job_id!r}) did not end within {self.stop_timeout_s:g} s "
            "of scancel"
        )

    def adopt(self, launch: Launch) -> bool:
        """A restarted executor takes over the Slurm job of ``launch`` if Slurm still queues or
        runs it (found by its job name); else it is gone and resumes from its checkpoint."""
        name = f"polytrain-{launch.job_id}"
        out = self._call("squeue", "-h", "--name", name, "-o", "%i")
        ids = out.split()
        if not ids:
            return False
        self._running[launch.job_id] = ids[-1]
        self.submitted.setdefault(launch.job_id, []).append(ids[-1])
        return True

    def poll(self) -> dict[str, int]:
        ended: dict[str, int] = {}
        for job_id, slurm_id in list(self._running.items()):
            record = self.record(slurm_id)
            code = 1 if record is None else exit_code(record)  # forgotten by Slurm: lost
            if code is not None:
                ended[job_id] = code
                del self._running[job_id]
        return ended

"""A one-host Slurm cluster for tests: munged, slurmctld and two slurmd nodes in a temp dir.

Slurm's Debian build runs several slurmd on one host (``MULTIPLE_SLURMD``): each node has its
own name (``-N n1``), port and spool directory, and every node's address is 127.0.0.1, so a
two-node job really is two launchers meeting through torch's rendezvous on loopback. Nothing
here touches /etc: munge has its own key and socket, Slurm its own ``slurm.conf``, and every
command is pointed at it through ``SLURM_CONF``. Daemons run in the foreground (``-D``) as our
children and are stopped by the PIDs we started (SIGTERM, then SIGKILL after a grace period).

Where the binaries are missing the helper installs the Debian packages when it runs as root
with apt (``slurmctld slurmd slurm-client munge``, ~7 s); otherwise, or when anything fails,
:func:`start_cluster` raises :class:`SlurmUnavailable` with a one-line reason for the skip.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["NODES", "SlurmCluster", "SlurmUnavailable", "start_cluster"]

NODES = ("n1", "n2")
CPUS_PER_NODE = 2  # declared, not detected (SlurmdParameters=config_overrides)
_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")
_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")


class SlurmUnavailable(RuntimeError):
    """Why no Slurm cluster could be started here (the test skips with this one line)."""


@dataclass
class SlurmCluster:
    """A running test cluster: its config file, the environment that reaches it, its nodes."""

    root: Path
    conf: Path
    nodes: tuple[str, ...] = NODES
    cpus_per_node: int = CPUS_PER_NODE
    partition: str = "debug"
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def log(self, name: str) -> str:
        """A daemon's log (``slurmctld``, ``slurmd.n1``, ...), for a failing test's message."""
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _ensure_binaries() -> None:
    missing = [b for b in _BINARIES if shutil.which(b) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SlurmUnavailable(
            f"Slurm not installed ({', '.join(missing)} missing) and no root apt"
        )
    cmd = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *_PACKAGES]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        if done.returncode != 0:  # a fresh image has no package lists yet
            update = ["apt-get", "update", "-qq"]
            subprocess.run(update, env=env, capture_output=True, text=True, timeout=180)
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        raise SlurmUnavailable("apt-get install of Slurm timed out") from None
    still = [b for b in _BINARIES if shutil.which(b) is None]
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise SlurmUnavailable(f"apt-get install of Slurm failed: {last}")
    if still:
        raise SlurmUnavailable(f"{', '.join(still)} not on PATH after apt-get install")


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _write_conf(root: Path, ports: list[int]) -> Path:
    ctld, *node_ports = ports
    lines = [
        "ClusterName=polytrain-test",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={ctld}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root}/munge/munge.socket",
        "CommunicationParameters=NoInAddrAny",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd.%n.pid",
        f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd.%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SlurmdParameters=config_overrides",
        "MpiDefault=none",
        "JobRequeue=1",
        "ReturnToService=2",
        "MinJobAge=3600",  # keep ended jobs visible to `scontrol show job` (no accounting)
        "KillWait=5",  # SIGTERM -> SIGKILL grace on scancel (default 30 s)
        "SchedulerParameters=sched_interval=1",
        # Job ids (and so rendezvous ports, [Note: rendezvous port]) differ between clusters
        # that run at once on one host, e.g. two test sessions.
        f"FirstJobId={random.randrange(1, 9000)}",
    ]
    for name, port in zip(NODES, node_ports, strict=True):
        lines.append(
            f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname=localhost Port={port} "
            f"CPUs={CPUS_PER_NODE} State=UNKNOWN"
        )
    lines.append(
        f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP"
    )
    conf = root / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    return conf


def _start_munge(root: Path) -> subprocess.Popen[bytes]:
    munge = root / "munge"
    munge.mkdir(mode=0o755)
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    cmd = [
        "munged",
        "--foreground",
        "--force",
        f"--key-file={key}",
        f"--socket={munge}/munge.socket",
        f"--pid-file={munge}/munged.pid",
        f"--log-file={munge}/munged.log",
        f"--seed-file={munge}/munged.seed",
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait(what: str, ready: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise SlurmUnavailable(f"{what} not ready within {timeout_s:g} s")


def _stop(procs: dict[str, subprocess.Popen[bytes]], grace_s: float = 5.0) -> None:
    """SIGTERM every daemon we started (by PID), then SIGKILL whatever outlives the grace."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)


def _drain(env: dict[str, str], timeout_s: float = 10.0) -> None:
    """Cancel every job still known and wait until none is running or completing, so that each
    slurmstepd reports to a live slurmd and exits on its own."""
    run = {"env": env, "capture_output": True, "text": True, "timeout": 10}
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        subprocess.run(["scancel", "--user", str(os.geteuid())], **run)  # type: ignore[call-overload]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = subprocess.run(["squeue", "-h", "-o", "%i"], **run).stdout  # type: ignore[call-overload]
            if not out.strip():
                return
            time.sleep(0.2)


def _stray_stepds(conf: Path) -> list[int]:
    """slurmstepd processes of this cluster that outlived it, found by ``SLURM_CONF`` in their
    environment (a step daemon detaches from slurmd, so it is not our child)."""
    found = []
    marker = f"SLURM_CONF={conf}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "slurmstepd":
                continue
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@contextlib.contextmanager
def start_cluster(root: Path, timeout_s: float = 20.0) -> Iterator[SlurmCluster]:
    """munged + slurmctld + one slurmd per node under ``root``, up and idle; stopped on exit."""
    _ensure_binaries()
    for sub in ("state", "spool/n1", "spool/n2"):
        (root / sub).mkdir(parents=True)
    conf = _write_conf(root, _free_ports(1 + len(NODES)))
    cluster = SlurmCluster(root=root, conf=conf)
    env = cluster.env
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        procs["munged"] = _start_munge(root)
        _wait("munged", (root / "munge" / "munge.socket").exists, timeout_s)
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env}
        procs["slurmctld"] = subprocess.Popen(["slurmctld", "-D", "-i"], **quiet)  # type: ignore[call-overload]
        for node in NODES:
            procs[f"slurmd-{node}"] = subprocess.Popen(["slurmd", "-D", "-N", node], **quiet)  # type: ignore[call-overload]
        cluster.pids = {name: p.pid for name, p in procs.items()}

        def idle() -> bool:
            dead = [name for name, p in procs.items() if p.poll() is not None]
            if dead:
                raise SlurmUnavailable(f"{', '.join(dead)} exited at start (see {root})")
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"],
                env=env,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.split()
            return out.count("idle") == len(NODES)

        _wait("Slurm nodes", idle, timeout_s)
        yield cluster
    finally:
        if "slurmctld" in procs:
            _drain(env)
        _stop(procs)
        for pid in _stray_stepds(conf):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

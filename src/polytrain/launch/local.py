"""Run a job's workers under the torch elastic agent, locally or as one node of many.

[Note: rendezvous address] With one node and no ``--rdzv-endpoint`` (or one on a loopback
address, see `loopback_port`) the rendezvous store and the workers' master address are
``127.0.0.1`` on a free port (the named one), and gloo is pinned to the loopback
interface, so a local run accepts no connection from another host (torch's stores would listen
on every interface; see [Note: loopback rendezvous] in launch/loopback.py). Naming an endpoint (multi-node)
makes the store listen where the user said (launch/multinode.py); see docs/multihost.md for what
that exposes.

Workers' output: rank 0's stdout reaches the terminal (progress bar, summary); every rank's
stderr and the other ranks' stdout go to ``<run dir>/logs``. A failure is reported once, as the
failing rank and its exception, taken from the error file torch elastic's ``record`` writes.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig as ElasticConfig

from polytrain.config.job import JobConfig
from polytrain.launch import loopback, multinode, node_guard
from polytrain.launch.tolerant import launch_tolerant

__all__ = [
    "Interrupted",
    "WorkerFailure",
    "launch",
    "loopback_port",
    "shutdown_grace_s",
]

# Signals that stop a run on purpose (Ctrl-C, kill, a closed terminal): exit 130, no traceback.
_STOP_SIGNALS = {"SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT"}


class Interrupted(Exception):
    """The launcher was told to stop (SIGINT / SIGTERM); ``signal`` names the signal."""

    def __init__(self, signal: str, note: str = "") -> None:
        super().__init__(signal, note)
        self.signal, self.note = signal, note

    def __str__(self) -> str:
        return f"interrupted ({self.signal}){'; ' + self.note if self.note else ''}"


def shutdown_grace_s(timeout_s: float) -> int:
    """Seconds the agent waits after SIGTERM before it SIGKILLs the workers.

    [Note: stopped ranks] torch's default is 30 s. A SIGSTOPped (or otherwise frozen) worker
    never acts on SIGTERM, so after a healthy rank has named it (within ``launch.timeout_s``,
    [Note: hang diagnosis]) the run sat 30 s more before the report (more than once: torch's
    process context also closes the group with a fixed 30 s grace; launch/tolerant.py polls
    the workers itself to avoid that). Our workers need no graceful shutdown (a checkpoint
    counts only once committed), so the grace is short.
    """
    return max(1, min(3, int(timeout_s)))


@dataclass
class WorkerFailure(Exception):
    """A worker process failed; ``message`` is one line naming its rank and error."""

    rank: int
    exc_type: str
    message: str
    log_dir: str
    role: str = ""  # what the rank serves besides training (`StrategyFamily.rank_roles`)

    def __str__(self) -> str:
        role = f" ({self.role})" if self.role else ""
        return f"worker rank {self.rank}{role} failed: {self.exc_type}: {self.message}"


def _failure_of(err: ChildFailedError, log_dir: Path) -> WorkerFailure:
    rank, failure = err.get_first_failure()
    exc_type, message = "exit", f"exit code {failure.exitcode}"
    if failure.signal_name() != "<N/A>" and failure.exitcode < 0:
        message = f"killed by {failure.signal_name()}"
    error_file = Path(failure.error_file) if failure.error_file else None
    if error_file and error_file.is_file():
        data = json.loads(error_file.read_text()).get("message", {})
        text = data.get("message", "") if isinstance(data, dict) else str(data)
        # The recorded message is "ExcType: text", possibly followed by more lines; keep the first.
        first = text.strip().splitlines()[0] if text.strip() else ""
        exc_type, _, rest = first.partition(": ")
        message = rest or first
    return WorkerFailure(rank, exc_type, message, str(log_dir))


def loopback_port(endpoint: str) -> int | None:
    """The port of a ``HOST:PORT`` endpoint whose host is a loopback address, else None.

    [Note: rendezvous address] ``--rdzv-endpoint 127.0.0.1:P`` (or ``localhost:P``, ``[::1]:P``)
    names this host only, so a one-node run with it uses the loopback rendezvous on port P
    instead of torch's stores, which would listen on every interface (``*:P`` and a second
    port) although the user named loopback."""
    host, sep, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit():
        return None
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (socket.gaierror, UnicodeError):
        return None
    if addresses and all(ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in addresses):
        return int(port)
    return None


def launch(
    job: JobConfig,
    job_path: Path,
    run_dir: Path,
    tolerated: Sequence[int] = (),
    roles: Mapping[int, str] | None = None,
) -> None:
    """Start ``job.launch.nproc`` workers on this node running ``job_path``; wait for them.

    ``tolerated``: the ranks whose death the job survives (its strategy family declares them,
    `core.registry.StrategyFamily.tolerated_ranks`; [Note: tolerated worker deaths]);
    ``roles``: what a rank serves besides training, named when it fails (``rank_roles``)."""
    lc = job.launch
    port = 0 if not lc.rdzv_endpoint else loopback_port(lc.rdzv_endpoint)
    local = lc.nnodes == 1 and port is not None
    endpoint = f"127.0.0.1:{port}" if local else lc.rdzv_endpoint
    node_addr = "127.0.0.1" if local else multinode.node_address(endpoint)
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    redirects = {r: (Std.ERR if r == 0 else Std.ALL) for r in range(lc.num_procs)}
    config = ElasticConfig(
        min_nodes=lc.nnodes,
        max_nodes=lc.nnodes,
        nproc_per_node=lc.num_procs,
        run_id=uuid.uuid4().hex if local else "polytrain",
        rdzv_backend=loopback.BACKEND if local else multinode.BACKEND,
        rdzv_endpoint=endpoint,
        rdzv_configs={"timeout": 900} if local else multinode.rdzv_configs(lc),
        max_restarts=lc.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        local_addr=node_addr,
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=redirects),
    )
    loopback.register()  # [Note: loopback rendezvous]
    multinode.register()  # [Note: who hosts the store]
    env_before = dict(os.environ)
    # One compute thread per worker unless the user chose otherwise: N workers on N cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    iface = "lo" if local else multinode.interface_of(node_addr)
    if iface:  # [Note: listening only where the user said]
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher")
    # The agent logs each failure (and each signal) with its own format; we report it once,
    # below. Its modules' loggers carry their own levels, so each is set, not only the parents.
    for name in [*prefixes, *logging.root.manager.loggerDict]:
        if name.startswith(prefixes):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    args = ["-u", "-m", "polytrain.trainer.worker", str(job_path)]
    try:  # our agent for every job: [Note: stopped ranks], [Note: tolerated worker deaths]
        launch_tolerant(
            config,
            sys.executable,
            args,
            list(tolerated),
            grace_s=shutdown_grace_s(lc.timeout_s),  # [Note: stopped ranks]
        )
    except SignalException as exc:  # torch elastic turns SIGINT/SIGTERM into this
        raise Interrupted(exc.sigval.name) from None
    except ChildFailedError as err:
        failure = _failure_of(err, log_dir)
        failure.role = (roles or {}).get(failure.rank, "")
        if failure.exc_type == "KeyboardInterrupt" or failure.message in {
            f"killed by {name}" for name in _STOP_SIGNALS
        }:  # Ctrl-C reached the workers first (the whole process group gets it)
            raise Interrupted(
                "SIGINT"
                if failure.exc_type == "KeyboardInterrupt"
                else failure.message.rsplit(" ", 1)[1]
            ) from None
        if not local:
            failure.message += multinode.hosts_note(lc.num_procs)
        raise failure from None
    finally:
        node_guard.stop_all()  # [Note: lost node]
        os.environ.clear()
        os.environ.update(env_before)

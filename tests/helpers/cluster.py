"""Emulated-cluster helpers for tests: a skipping fixture factory and a node runner."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from polytrain.testing.cluster import Cluster, Host, LinkSpec, unavailable_reason

__all__ = ["NodeResult", "emulated_cluster", "node_env", "run_nodes", "single_process"]

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"


def node_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(SRC), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def emulated_cluster(num_hosts: int, link: LinkSpec | None = None) -> Iterator[Cluster]:
    """Yield a started cluster, or skip with the reason; always stopped afterwards."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = Cluster(num_hosts, link=link)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@dataclass
class NodeResult:
    host: Host
    returncode: int | None  # None: still running at the deadline (then killed)
    stdout: str
    stderr: str
    seconds: float


def run_nodes(
    cluster: Cluster,
    node_args: Sequence[Sequence[str]],
    *,
    cwd: Path,
    timeout: float = 300.0,
) -> list[NodeResult]:
    """Run ``polytrain`` with ``node_args[i]`` on host i, all at once; wait for every one."""
    start = time.monotonic()
    procs = [
        host.popen(
            [sys.executable, "-m", "polytrain.cli.app", *args],
            cwd=cwd,
            env=node_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for host, args in zip(cluster.hosts, node_args, strict=False)
    ]
    results = []
    for host, proc in zip(cluster.hosts, procs, strict=False):
        left = max(1.0, timeout - (time.monotonic() - start))
        try:
            out, err = proc.communicate(timeout=left)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            code = None
        results.append(NodeResult(host, code, out, err, time.monotonic() - start))
    return results


def single_process(args: Sequence[str], *, cwd: Path, timeout: float = 300.0) -> None:
    """Run ``polytrain`` on this machine (the reference run); assert it succeeded."""
    proc = subprocess.run(
        [sys.executable, "-m", "polytrain.cli.app", *args],
        cwd=cwd,
        env=node_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr

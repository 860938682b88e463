"""Multi-host mistakes and faults on emulated hosts: one clear line per node, exit code 2 for a
mistake, within the timeout, and no process left behind in any host (issue 16)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from polytrain.testing.cluster import Cluster, LinkSpec
from tests.helpers.cluster import NodeResult, emulated_cluster, node_env, run_nodes

pytestmark = pytest.mark.slow

PORT = 29533
TIMEOUT_S = 15
# An unreachable endpoint is found at --timeout (the rendezvous client's connect deadline),
# however loaded the machine: a short one proves the same line and bound.
UNREACHABLE_TIMEOUT_S = 4


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    yield from emulated_cluster(2, LinkSpec(rate_mbit=1000))


def _node(
    nnodes: int,
    node_rank: int,
    endpoint: str,
    *extra: str,
    timeout_s: int = TIMEOUT_S,
    out_dir: str = "",
) -> list[str]:
    # The emulated hosts share one file system, real hosts do not: each needs its own run
    # directory (a shared one is refused by the run lock before the rendezvous starts).
    return [
        "train", "--model", "mlp", "--steps", "2", "--no-progress",
        "--timeout", str(timeout_s), "--nproc", "2", "--nnodes", str(nnodes),
        "--node-rank", str(node_rank), "--rdzv-endpoint", endpoint,
        "--out-dir", out_dir or f"node{node_rank}", *extra,
    ]  # fmt: skip


def _one_line(result: NodeResult) -> str:
    """The node's error line; C++ warnings from torch may precede it, a traceback may not."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("polytrain: error")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def _nothing_left(cluster: Cluster) -> None:
    for host in cluster.hosts:
        assert host.pids() == [], f"processes left on host {host.addr}"


def test_unreachable_endpoint(cluster: Cluster, tmp_path: Path) -> None:
    host = cluster.hosts[0]  # run_nodes starts node_args[i] on host i
    args = _node(2, 1, f"10.77.0.9:{PORT}", timeout_s=UNREACHABLE_TIMEOUT_S)
    [result] = run_nodes(cluster, [args], cwd=tmp_path, timeout=200)
    assert result.returncode == 2, result.stderr
    line = _one_line(result)
    assert "could not reach the rendezvous endpoint 10.77.0.9" in line
    assert f"within {UNREACHABLE_TIMEOUT_S} s" in line
    assert host.addr in line
    # the timeout, plus start-up on a loaded machine
    assert result.seconds < UNREACHABLE_TIMEOUT_S + 90
    _nothing_left(cluster)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([(2, 0), (4, 1)], "the nodes disagree on --nnodes"),
        ([(2, 0), (2, 0)], "both passed --node-rank 0"),
    ],
    ids=["nnodes", "node-rank"],
)
def test_nodes_that_disagree(
    cluster: Cluster, tmp_path: Path, flags: list[tuple[int, int]], message: str
) -> None:
    """Both nodes report the mistake, each within the timeout of its own start; the long
    timeout only absorbs the nodes' start-up skew on a loaded machine (the second node to
    arrive finds the mistake at once)."""
    endpoint = f"{cluster.hosts[0].addr}:{PORT}"
    args = [
        _node(n, r, endpoint, timeout_s=90, out_dir=f"node{i}") for i, (n, r) in enumerate(flags)
    ]
    results = run_nodes(cluster, args, cwd=tmp_path, timeout=300)
    for result in results:
        assert result.returncode == 2, result.stderr
        line = _one_line(result)
        assert message in line
        assert result.seconds < 90, result.seconds  # found on arrival, not at the timeout
        assert all(h.addr in line for h in cluster.hosts), line  # names both hosts
    assert not list(tmp_path.glob("node*/metrics.jsonl"))  # no worker ever trained
    _nothing_left(cluster)


def test_link_drop_mid_run_fails_within_timeout(cluster: Cluster, tmp_path: Path) -> None:
    """Host 1's cable is pulled after training started: both nodes stop with one error line
    naming the other host within the timeout (plus the agents' shutdown and start-up slack on
    a loaded machine), and nothing is left running."""
    endpoint = f"{cluster.hosts[0].addr}:{PORT}"
    args = [_node(2, i, endpoint, "--steps", "100000", "--dp", "4") for i in range(2)]
    procs = [
        h.popen(
            [sys.executable, "-m", "polytrain.cli.app", *a],
            cwd=tmp_path,
            env=node_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for h, a in zip(cluster.hosts, args, strict=True)
    ]
    metrics = tmp_path / "node0" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert time.monotonic() < deadline, "training never started"
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.5)
    cut_at = time.monotonic()
    cluster.cut(1)
    outs = [p.communicate(timeout=TIMEOUT_S * 4 + 120) for p in procs]
    waited = time.monotonic() - cut_at
    for proc, (_, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 1, err
        assert "Traceback" not in err, err
    assert waited < TIMEOUT_S * 4 + 120
    # The hosting side: its collective timed out; the message names the ranks and their hosts.
    host0 = [line for line in outs[0][1].splitlines() if "polytrain: error" in line]
    assert len(host0) == 1 and "did not arrive" in host0[0] and "10.77.0.2" in host0[0], outs[0][1]
    # The cut-off side: its guard stopped it ([Note: lost node]).
    host1 = [line for line in outs[1][1].splitlines() if "polytrain: error" in line]
    assert len(host1) == 1 and "lost its network path" in host1[0], outs[1][1]
    assert "10.77.0.1" in host1[0]
    print(f"both nodes stopped within {waited:.0f} s of the cut")
    _nothing_left(cluster)

"""Two emulated hosts x two workers through the real rendezvous (issue 16).

Each host is a network namespace whose hostname resolves to 127.0.0.1, not to its address
([Note: emulated hostnames] in polytrain/testing/cluster.py): the setup in which torch's own
c10d rendezvous left both nodes waiting as clients.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from polytrain.testing import max_abs_diff
from polytrain.testing.cluster import Cluster, LinkSpec
from tests.helpers.cluster import emulated_cluster, run_nodes, single_process

pytestmark = pytest.mark.slow

PORT = 29511
JOB = ["--steps", "3", "--seed", "3", "--optimizer", "sgd", "--no-progress", "--timeout", "120"]


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    yield from emulated_cluster(2, LinkSpec(rate_mbit=1000))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The default job (gpt tiny) in one process: the weights every layout must reproduce."""
    tmp = tmp_path_factory.mktemp("single")
    single_process(
        ["train", *JOB, "--nproc", "1", "--save-final", "one.safetensors", "--out-dir", "run"],
        cwd=tmp,
    )
    return load_file(str(tmp / "one.safetensors"))


def _node(host_rank: int, endpoint: str, *extra: str) -> list[str]:
    return [
        "train",
        *JOB,
        "--nproc",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        str(host_rank),
        "--rdzv-endpoint",
        endpoint,
        "--save-final",
        "two_hosts.safetensors",
        "--out-dir",
        f"node{host_rank}",
        *extra,
    ]


def _listeners(cluster: Cluster) -> set[tuple[int, str]]:
    """(host, local address) of every listening TCP socket in the hosts."""
    found = set()
    for host in cluster.hosts:
        out = host.run(["ss", "-Hltn"]).stdout
        for line in out.splitlines():
            local = line.split()[3]
            found.add((host.index, local.rsplit(":", 1)[0]))
    return found


def test_dp4_on_two_hosts_matches_one_process(
    cluster: Cluster, reference: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """The issue's report: both nodes now meet, train, and reproduce the one-process run.

    While the job runs, every listening socket in the hosts is bound to that host's address
    (or loopback), never to all interfaces.
    """
    endpoint = f"{cluster.hosts[0].addr}:{PORT}"
    args = [_node(i, endpoint, "--dp", "4") for i in range(2)]
    listeners: set[tuple[int, str]] = set()
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(run_nodes, cluster, args, cwd=tmp_path, timeout=400)
        while not job.done():
            listeners |= _listeners(cluster)
            time.sleep(0.5)
        results = job.result()
    for r in results:
        assert r.returncode == 0, f"host {r.host.addr}: {r.stderr[-3000:]}"
    assert "final loss" in results[0].stdout  # node rank 0 holds global rank 0
    two = load_file(str(tmp_path / "two_hosts.safetensors"))
    assert set(two) == set(reference)
    assert max_abs_diff(two, reference) <= 1e-5
    # parallel.hierarchical = auto (the default) measured both all-reduces across the hosts.
    log = "".join(p.read_text() for p in (tmp_path / "node0" / "logs").rglob("stderr.log"))
    assert "dp all-reduce: hierarchical (flat" in log or "dp all-reduce: flat (flat" in log, log
    assert (0, cluster.hosts[0].addr) in listeners  # the rendezvous store, on node 0
    allowed = {(h.index, h.addr) for h in cluster.hosts} | {
        (h.index, "127.0.0.1") for h in cluster.hosts
    }
    assert listeners <= allowed, sorted(listeners - allowed)


def test_dp2_pp2_on_two_hosts_with_swapped_node_ranks(
    cluster: Cluster, reference: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """The endpoint's host passes ``--node-rank 1``: it still hosts the rendezvous, the other
    host holds global ranks 0-1 (pipeline stage 0), and the weights match the one-process run."""
    endpoint = f"{cluster.hosts[0].addr}:{PORT}"
    extra = ("--dp", "2", "--pp", "2", "--partition", "uniform")
    results = run_nodes(
        cluster, [_node(1, endpoint, *extra), _node(0, endpoint, *extra)], cwd=tmp_path, timeout=400
    )
    for r in results:
        assert r.returncode == 0, f"host {r.host.addr}: {r.stderr[-3000:]}"
    assert "final loss" in results[1].stdout and "final loss" not in results[0].stdout
    two = load_file(str(tmp_path / "two_hosts.safetensors"))
    assert set(two) == set(reference)
    assert max_abs_diff(two, reference) <= 1e-5

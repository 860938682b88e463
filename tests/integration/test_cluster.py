"""The emulated cluster itself: hosts reach each other, links are as slow as asked, a cut link
carries nothing, and nothing is left behind even when the test body raises."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from polytrain.testing.cluster import Cluster, LinkSpec, unavailable_reason

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason())),
]

SERVER = """
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 5999)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = len(c.recv(1 << 16)); t = time.monotonic()
while (b := c.recv(1 << 16)): n += len(b)
print(n, time.monotonic() - t, flush=True)
"""
CLIENT = """
import socket, sys
s = socket.create_connection((sys.argv[1], 5999), timeout=5)
s.sendall(b"x" * int(sys.argv[2])); s.close()
"""


def _send(cluster: Cluster, nbytes: int) -> tuple[subprocess.CompletedProcess[str], str]:
    dst = cluster.hosts[0]
    server = dst.popen([sys.executable, "-c", SERVER, dst.addr], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    sent = cluster.hosts[1].run([sys.executable, "-c", CLIENT, dst.addr, str(nbytes)], timeout=60)
    got = server.communicate(timeout=60)[0].strip() if sent.returncode == 0 else ""
    return sent, got


def test_rate_limit_is_a_lower_bound_on_transfer_time() -> None:
    # 2 MB over 10 Mbit/s cannot take less than 1.6 s, however idle or busy the machine is.
    with Cluster(2, link=LinkSpec(rate_mbit=10)) as cluster:
        sent, got = _send(cluster, 2_000_000)
        assert sent.returncode == 0, sent.stderr
        nbytes, seconds = got.split()  # measured where the bytes arrive
        assert nbytes == "2000000"
        assert float(seconds) > 0.8 * 2_000_000 * 8 / 10e6


def test_cut_link_carries_nothing() -> None:
    with Cluster(2) as cluster:
        cluster.cut(1)
        sent, _ = _send(cluster, 10)
        assert sent.returncode != 0  # connect timed out: no route through a dead port


def test_cleanup_even_when_the_body_raises() -> None:
    cluster = Cluster(2)
    with pytest.raises(RuntimeError, match="boom"), cluster:
        cluster.hosts[0].popen(["sleep", "600"])
        raise RuntimeError("boom")
    assert not cluster.exists()
    time.sleep(0.1)
    assert all(p.poll() is not None for h in cluster.hosts for p in h.procs)


RANK = """
import os, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} local {os.environ['LOCAL_RANK']} on {sys.argv[1]}", file=sys.stderr)
if rank == int(sys.argv[1]):
    sys.exit(3)
time.sleep(float(sys.argv[2]))
"""


def test_run_ranks_waits_for_all_and_raises_on_the_first_failure() -> None:
    """Every rank gets its place (LOCAL_RANK counts per host); a failing rank raises with its
    stderr at once, while the others would still be running for a minute."""
    with Cluster(2) as cluster:
        args = [sys.executable, "-c", RANK]
        cluster.run_ranks([0, 0, 1], [*args, "-1", "0"], port=29999, pythonpath="", timeout_s=60)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"a toy rank failed .*rank 2 of 3, host 1, exit 3"):
            cluster.run_ranks(
                [0, 0, 1], [*args, "2", "60"], port=29999, pythonpath="", timeout_s=120,
                what="a toy rank",
            )  # fmt: skip
        assert time.monotonic() - t0 < 30
        with pytest.raises(RuntimeError, match=r"rank 1 local 1 on 1"):  # second on host 0
            cluster.run_ranks([0, 0, 1], [*args, "1", "0"], port=29999, pythonpath="", timeout_s=60)
        with pytest.raises(TimeoutError, match=r"rank\(s\) \[0, 1\] still running after 1"):
            cluster.run_ranks([0, 1], [*args, "-1", "60"], port=29999, pythonpath="", timeout_s=1)

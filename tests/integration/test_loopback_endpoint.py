"""Issue 11, case 10: ``--rdzv-endpoint 127.0.0.1:P --nnodes 1`` listens on loopback only.

Before, the named loopback endpoint sent the run to torch's c10d rendezvous, whose stores
listen on every interface (``*:P`` and a second port). The listening sockets of the launcher
and its workers are read from /proc/net/tcp{,6} (no ``ss`` or psutil needed).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from polytrain.launch.local import loopback_port
from tests.helpers.cli_runs import start_train, wait_for, workers_of

pytestmark = pytest.mark.slow


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _address(hex_address: str) -> str:
    ip_hex, port_hex = hex_address.split(":")
    port = int(port_hex, 16)
    if len(ip_hex) == 8:  # IPv4, little-endian
        return f"{socket.inet_ntoa(bytes.fromhex(ip_hex)[::-1])}:{port}"
    raw = b"".join(bytes.fromhex(ip_hex[i : i + 8])[::-1] for i in range(0, 32, 8))
    return f"[{socket.inet_ntop(socket.AF_INET6, raw)}]:{port}"


def listening(pids: list[int]) -> list[str]:
    """``ip:port`` of every listening TCP socket the given processes hold."""
    inodes = set().union(*(_socket_inodes(p) for p in pids))
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(_address(fields[1]))
    return found


def test_loopback_endpoints_are_recognised() -> None:
    assert loopback_port("127.0.0.1:29500") == 29500
    assert loopback_port("localhost:7") == 7
    assert loopback_port("[::1]:8") == 8
    assert loopback_port("10.1.2.3:29500") is None
    assert loopback_port("127.0.0.1") is None


def test_a_loopback_endpoint_listens_on_loopback_only(tmp_path: Path) -> None:
    # Issue 11, case 10.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start_train(
        *("--model", "tests.helpers.faults:slow", "--set", "model.block_size=16"),
        *("--steps", "400", "--nproc", "2", "--no-progress", "--nnodes", "1"),
        *("--rdzv-endpoint", f"127.0.0.1:{port}", "--out-dir", str(tmp_path / "run")),
        cwd=tmp_path,
    )
    try:
        wait_for(lambda: (tmp_path / "run" / "metrics.jsonl").exists(), 300, "step 1")
        addresses = listening([proc.pid, *workers_of(proc.pid)])
    finally:
        proc.kill()
        proc.communicate()
    assert addresses, "no listening socket found"
    assert all(a.startswith("127.0.0.1:") for a in addresses), addresses
    assert f"127.0.0.1:{port}" in addresses  # the port the user named is the rendezvous

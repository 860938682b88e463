"""An emulated cluster on one machine: H hosts as Linux network namespaces behind one switch.

Each host is a network namespace with an ``eth0`` (a veth pair whose other end sits on a bridge
in a separate "switch" namespace) and the address ``<subnet>.<i + 1>``. Its link is shaped in
both directions with ``tc`` (``tbf`` for a rate limit, ``netem`` for latency), so traffic
between hosts pays a real link's bandwidth and latency while traffic inside a host stays on its
loopback. Nothing touches the machine's own network namespace: the bridge lives in the switch
namespace and every address is private to the namespaces created here.

[Note: emulated hostnames] Network namespaces share the machine's UTS namespace, so every host
has the machine's hostname, which resolves to 127.0.0.1 (or to nothing) rather than to the
host's ``eth0`` address: the situation in containers and pods, and the one in which torch's
rendezvous cannot tell by name which node should host its store (issue 16).

Cleanup is guaranteed three ways: the context manager's ``__exit__``, an ``atexit`` hook for an
interpreter that dies between the two, and ``stop`` being idempotent (the pytest fixture in
tests/helpers/cluster.py calls it from its finaliser). Processes started through `Host.popen`
run in their own session and are killed by process group before the namespaces go.

Needs root and iproute2 (``ip``, ``tc``); `unavailable_reason` says why not, for pytest skips.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Cluster", "Host", "LinkSpec", "unavailable_reason"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _netns(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", ns, *args], capture_output=True, text=True, check=check
    )


def unavailable_reason() -> str | None:
    """Why an emulated cluster cannot be built here, or None when it can."""
    if os.geteuid() != 0:
        return "emulated cluster needs root (network namespaces, veth, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"emulated cluster needs `{tool}` (apt-get install iproute2)"
    probe = f"ptprobe{os.getpid() % 100000}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class LinkSpec:
    """One host's link to the switch, applied in both directions.

    ``rate_mbit`` None means unlimited (veth speed); ``delay_ms`` is one-way latency per hop, so
    a host-to-host round trip pays ``4 * delay_ms`` (two hops each way). Latency needs the
    kernel's ``netem`` qdisc (``sch_netem``), which some kernels lack; a rate alone uses ``tbf``.
    """

    rate_mbit: float | None = None
    delay_ms: float = 0.0

    def qdisc_args(self, loss_pct: float = 0.0) -> list[str]:
        """``tc qdisc`` arguments: ``tbf`` for a rate alone, ``netem`` for latency or loss.

        [Note: tbf burst] A token bucket smaller than one timer tick's worth of bytes cannot
        reach its rate; ``rate / 250`` bytes (4 ms at HZ=250) with a 32 KiB floor does.
        """
        if self.delay_ms or loss_pct:
            args = ["netem", "delay", f"{self.delay_ms}ms", "limit", "10000"]
            if self.rate_mbit is not None:
                args += ["rate", f"{self.rate_mbit}mbit"]
            return args + (["loss", f"{loss_pct}%"] if loss_pct else [])
        if self.rate_mbit is None:
            return []  # unshaped
        burst = max(32 * 1024, int(self.rate_mbit * 1e6 / 8 / 250))
        return ["tbf", "rate", f"{self.rate_mbit}mbit", "burst", str(burst), "latency", "100ms"]


@dataclass
class Host:
    """One emulated host: its namespace, its address on the cluster network, its processes."""

    index: int
    netns: str
    addr: str
    switch_port: str  # the veth end on the switch (shaped for traffic towards this host)
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    def command(self, args: Sequence[str]) -> list[str]:
        """``args`` wrapped to run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *args]

    def popen(self, args: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``args`` in this host, in its own session (killed with the cluster)."""
        proc: subprocess.Popen[Any] = subprocess.Popen(
            self.command(args), start_new_session=True, **kwargs
        )
        self.procs.append(proc)
        return proc

    def run(
        self, args: Sequence[str], *, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``args`` in this host and wait; output captured as text."""
        return subprocess.run(
            self.command(args), capture_output=True, text=True, timeout=timeout, check=False
        )

    def pids(self) -> list[int]:
        """Every process now running in this host's namespace."""
        out = _ip("netns", "pids", self.netns, check=False).stdout
        return [int(p) for p in out.split()]


class Cluster:
    """``num_hosts`` emulated hosts on one switch; a context manager that always cleans up.

    >>> with Cluster(2, link=LinkSpec(rate_mbit=1000, delay_ms=0.5)) as cluster:
    ...     cluster.hosts[1].run(["ping", "-c1", cluster.hosts[0].addr])
    """

    def __init__(
        self,
        num_hosts: int,
        *,
        link: LinkSpec | None = None,
        subnet: str = "10.77.0",
    ) -> None:
        if not 1 <= num_hosts <= 200:
            raise ValueError(f"num_hosts = {num_hosts}: expected 1..200")
        tag = f"{os.getpid() % 100000}{int(time.monotonic() * 1000) % 1000}"
        self.tag = tag
        self.link = link or LinkSpec()
        self.subnet = subnet
        self.switch = f"pt{tag}sw"
        self.hosts = [
            Host(i, f"pt{tag}h{i}", f"{subnet}.{i + 1}", f"s{tag}h{i}") for i in range(num_hosts)
        ]
        self._up = False

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        atexit.register(self.stop)
        self._up = True
        try:
            _ip("netns", "add", self.switch)
            _netns(self.switch, "ip", "link", "add", "br0", "type", "bridge")
            _netns(self.switch, "ip", "link", "set", "br0", "up")
            for host in self.hosts:
                self._add_host(host)
        except BaseException:
            self.stop()
            raise

    def _add_host(self, host: Host) -> None:
        _ip("netns", "add", host.netns)
        _ip("link", "add", "name", "eth0", "netns", host.netns, "type", "veth", "peer", "name",
            host.switch_port, "netns", self.switch)  # fmt: skip
        _netns(host.netns, "ip", "addr", "add", f"{host.addr}/24", "dev", "eth0")
        _netns(host.netns, "ip", "link", "set", "lo", "up")
        _netns(host.netns, "ip", "link", "set", "eth0", "up")
        _netns(self.switch, "ip", "link", "set", host.switch_port, "master", "br0")
        _netns(self.switch, "ip", "link", "set", host.switch_port, "up")
        self.shape(host.index, self.link)

    def rank_env(self, rank: int, world: int, port: int, pythonpath: str) -> dict[str, str]:
        """The environment of torch.distributed rank ``rank`` of ``world`` on this cluster:
        ``env://`` rendezvous at host 0's address, gloo on each host's ``eth0``, one thread."""
        return {
            **os.environ,
            "PYTHONPATH": pythonpath,
            "MASTER_ADDR": self.hosts[0].addr,
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "GLOO_SOCKET_IFNAME": "eth0",
            "OMP_NUM_THREADS": "1",
        }

    def run_ranks(
        self,
        placement: Sequence[int],
        args: Sequence[str],
        *,
        port: int,
        pythonpath: str,
        timeout_s: float,
        what: str = "a rank",
    ) -> None:
        """Run rank ``r`` of ``len(placement)`` as ``args`` on host ``placement[r]`` (its
        `rank_env`, with ``LOCAL_RANK`` its index among that host's ranks) and wait for all.

        The first rank to exit non-zero raises `RuntimeError` with ``what``, the rank and the
        tail of its stderr, without waiting on the others (which may be blocked on it; leaving
        the cluster kills them). Each stderr goes to a file, so no rank blocks on a full pipe.
        """
        world, local = len(placement), dict.fromkeys(placement, 0)
        with contextlib.ExitStack() as files:
            running = []
            for rank, index in enumerate(placement):
                env = self.rank_env(rank, world, port, pythonpath)
                env["LOCAL_RANK"] = str(local[index])
                local[index] += 1
                err = files.enter_context(tempfile.TemporaryFile())
                running.append((rank, self.hosts[index].popen(args, env=env, stderr=err), err))
            deadline = time.monotonic() + timeout_s
            while running:
                for rank, proc, err in list(running):
                    code = proc.poll()
                    if code is None:
                        continue
                    running.remove((rank, proc, err))
                    if code != 0:
                        err.seek(0)
                        tail = err.read()[-3000:].decode(errors="replace")
                        raise RuntimeError(
                            f"{what} failed on the emulated cluster (rank {rank} of {world}, "
                            f"host {placement[rank]}, exit {code}): {tail}"
                        )
                if running and time.monotonic() > deadline:
                    ranks = [rank for rank, _, _ in running]
                    raise TimeoutError(f"{what}: rank(s) {ranks} still running after {timeout_s} s")
                time.sleep(0.05)

    def shape(self, index: int, link: LinkSpec, *, loss_pct: float = 0.0) -> None:
        """Set host ``index``'s link (both directions); ``loss_pct=100`` cuts it."""
        host = self.hosts[index]
        args = link.qdisc_args(loss_pct)
        for ns, dev in ((host.netns, "eth0"), (self.switch, host.switch_port)):
            if not args:
                _netns(ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
                continue
            done = _netns(ns, "tc", "qdisc", "replace", "dev", dev, "root", *args, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"tc qdisc {' '.join(args)} on {dev}: {done.stderr.strip()}")

    def cut(self, index: int) -> None:
        """Drop every packet to and from host ``index`` (a pulled cable: no reset is sent).

        Done by taking the switch's port down (works without ``netem``): the host keeps its
        address and its sockets, and its packets go nowhere.
        """
        _netns(self.switch, "ip", "link", "set", self.hosts[index].switch_port, "down")

    def stop(self) -> None:
        """Kill every process in the hosts, delete the namespaces; safe to call twice."""
        if not self._up:
            return
        self._up = False
        for host in self.hosts:
            for proc in host.procs:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            for proc in host.procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            # Anything else still in the namespace was started by us through `command`.
            for pid in host.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _ip("netns", "del", host.netns, check=False)
        _ip("netns", "del", self.switch, check=False)
        try:
            atexit.unregister(self.stop)
        except Exception:
            pass

    def exists(self) -> bool:
        """Whether any of this cluster's namespaces is still present (for cleanup tests)."""
        names = _ip("netns", "list", check=False).stdout
        return any(ns in names for ns in [self.switch, *(h.netns for h in self.hosts)])

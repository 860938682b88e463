"""Rendezvous across hosts: torch's c10d rendezvous, hosted by the node that owns the endpoint.

[Note: who hosts the store] torch's ``c10d`` backend decides whether this node hosts the
rendezvous store by matching the endpoint against the machine's hostname and the addresses that
hostname resolves to (``_matches_machine_hostname``). In containers, pods and our emulated hosts
the hostname resolves to 127.0.0.1 or to nothing, so no node recognises the endpoint as its own:
every node waits as a client and times out minutes later with a store stack trace (issue 16).
We decide by asking the kernel instead: this node hosts the store when it can bind a socket to
the endpoint's address, i.e. one of its interfaces carries that address.

[Note: listening only where the user said] torch's ``TCPStore`` server listens on every
interface whatever host name it is given. The rendezvous store is created on a socket bound to
the endpoint's address, and the store the agent shares with the workers (``MASTER_ADDR``) on a
socket bound to this node's address on the route to the endpoint (``local_address``); gloo is
pinned to that address's interface with ``GLOO_SOCKET_IFNAME`` (unless the user set it), since
its default (the hostname's address) is loopback in the same containers. docs/multihost.md
lists what remains reachable from the network.

[Note: node ranks] torch's c10d rendezvous numbers nodes by sorting their addresses and ignores
``--node-rank``. We keep the node rank the user gave (node 0 holds global ranks 0..nproc-1, as
with torchrun's static rendezvous), which makes a layout's placement predictable, and check
after each round, through the rendezvous store, that every node passed the same ``--nnodes``
and its own ``--node-rank``; a mistake is one `ClusterError` on every node naming the hosts,
raised before any worker starts.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import socket
import struct
import time
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    create_handler,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from polytrain._torch_private import set_store_server_factory
from polytrain.config.job import LaunchConfig
from polytrain.errors import ClusterError
from polytrain.launch.loopback import listening_store
from polytrain.launch.node_guard import NodeGuard

__all__ = [
    "BACKEND",
    "DEFAULT_PORT",
    "NodeInfo",
    "check_nodes",
    "hosts_note",
    "interface_of",
    "is_local_address",
    "local_address",
    "node_address",
    "rdzv_configs",
    "register",
    "resolve",
]

BACKEND = "polytrain-c10d"
DEFAULT_PORT = 29400
_SIOCGIFADDR = 0x8915


def resolve(host: str) -> str:
    """``host``'s IPv4 address; a `ClusterError` naming it when it does not resolve."""
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except (socket.gaierror, IndexError):
        raise ClusterError(
            f"rendezvous endpoint host {host!r} does not resolve to an IPv4 address: "
            "pass the address of node 0, e.g. --rdzv-endpoint 10.0.0.1:29400"
        ) from None


def is_local_address(addr: str) -> bool:
    """Whether one of this machine's interfaces carries ``addr`` (a bind to it succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((addr, 0))
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                return False
            raise
    return True


def local_address(endpoint_addr: str, port: int) -> str:
    """This node's source address on the route to ``endpoint_addr`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((endpoint_addr, port))
        except OSError as exc:
            raise ClusterError(
                f"no route from this node to the rendezvous endpoint {endpoint_addr}:{port} "
                f"({exc.strerror}): check the address and this host's network"
            ) from None
        addr: str = sock.getsockname()[0]
        return addr


def interface_of(addr: str) -> str | None:
    """The name of the interface carrying IPv4 ``addr``, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(reply[20:24]) == addr:
                return name
    return None


def _client_store(addr: str, port: int, timeout_s: float, me: str) -> dist.TCPStore:
    try:
        return dist.TCPStore(
            addr,
            port,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            use_libuv=True,
        )
    except (RuntimeError, TimeoutError, ValueError):
        raise ClusterError(
            f"node {me} could not reach the rendezvous endpoint {addr}:{port} within "
            f"{timeout_s:g} s: start the node whose address is {addr} (it hosts the "
            "rendezvous), or check --rdzv-endpoint and the firewall"
        ) from None


class NodeInfo:
    """What one node said on its command line, as exchanged through the rendezvous store."""

    def __init__(self, addr: str, node_rank: int, nnodes: int) -> None:
        self.addr, self.node_rank, self.nnodes = addr, node_rank, nnodes

    def encode(self) -> str:
        return f"{self.addr} {self.node_rank} {self.nnodes}"

    @classmethod
    def decode(cls, raw: bytes) -> NodeInfo:
        addr, node_rank, nnodes, *_ = raw.decode().split()
        return cls(addr, int(node_rank), int(nnodes))


def check_nodes(nodes: list[NodeInfo]) -> None:
    """One `ClusterError` naming the hosts when the nodes' flags disagree or collide."""
    counts = sorted({n.nnodes for n in nodes})
    if len(counts) > 1 or counts[0] != len(nodes):
        said = ", ".join(f"{n.addr} says {n.nnodes}" for n in nodes)
        raise ClusterError(
            f"the nodes disagree on --nnodes ({said}; {len(nodes)} joined): pass the same "
            "--nnodes on every node"
        )
    seen: dict[int, str] = {}
    for n in nodes:
        if n.node_rank in seen:
            raise ClusterError(
                f"nodes {seen[n.node_rank]} and {n.addr} both passed --node-rank "
                f"{n.node_rank}: give each node its own rank 0..{len(nodes) - 1}"
            )
        seen[n.node_rank] = n.addr


class _Backend(C10dRendezvousBackend):
    """torch's c10d rendezvous state machine, under our backend name."""

    @property
    def name(self) -> str:
        return BACKEND


def _create(params: RendezvousParameters) -> DynamicRendezvousHandler:
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    endpoint_addr = resolve(host)
    timeout_s = float(params.get_as_int("read_timeout", 60) or 60)
    told = params.get_as_bool("is_host")
    is_host = is_local_address(endpoint_addr) if told is None else told
    me = params.local_addr or local_address(endpoint_addr, port)
    params.local_addr = me
    store: dist.TCPStore | None = None
    if is_host:  # [Note: who hosts the store]
        try:
            store = listening_store(endpoint_addr, port, timeout_s)
        except OSError as exc:
            # As torch: several nodes of one job on one machine; the first one hosts.
            if told is not None or exc.errno != errno.EADDRINUSE:
                raise ClusterError(
                    f"cannot listen on the rendezvous endpoint {endpoint_addr}:{port} "
                    f"({exc.strerror}): pick a free port in --rdzv-endpoint"
                ) from None
            is_host = False
    if store is None:
        store = _client_store(endpoint_addr, port, timeout_s, me)
    handler = create_handler(store, _Backend(store, params.run_id), params)
    node = NodeInfo(me, int(params.get_as_int("node_rank", 0) or 0), params.max_nodes)

    def shared_server(master_addr: str, master_port: int) -> dist.TCPStore:
        return listening_store(me, 0, timeout_s)

    set_store_server_factory(handler, shared_server)
    guard = None if is_host else NodeGuard(me, endpoint_addr, port, timeout_s)
    handler.next_rendezvous = _checked_rounds(  # type: ignore[method-assign]
        handler, store, node, is_host, f"{endpoint_addr}:{port}", timeout_s, guard
    )
    return handler


_HELLO = "polytrain/hello"
LAST_NODES: list[NodeInfo] = []  # the nodes of this process's last round, by node rank


def _say_hello(store: dist.Store, node: NodeInfo) -> None:
    """Leave this node's flags in the store before joining, for `_join_failed` to read."""
    index = store.add(f"{_HELLO}/count", 1)
    store.set(f"{_HELLO}/{index}", f"{node.encode()} {os.getpid()}")


def _hellos(store: dist.Store) -> list[NodeInfo]:
    """Every node that said hello, the latest word of each (nodes on one machine share an
    address, so a node is its address and its agent's pid, which survives restarts)."""
    count = store.add(f"{_HELLO}/count", 0)
    raw = store.multi_get([f"{_HELLO}/{i}" for i in range(1, count + 1)])
    latest = {tuple(r.decode().split()[::3]): NodeInfo.decode(r) for r in raw}  # (addr, pid)
    return list(latest.values())


def _nnodes_clash(seen: list[NodeInfo]) -> ClusterError | None:
    if len({n.nnodes for n in seen}) < 2:
        return None
    said = ", ".join(f"{n.addr} says {n.nnodes}" for n in seen)
    return ClusterError(
        f"the nodes disagree on --nnodes ({said}): pass the same --nnodes on every node"
    )


def _join_failed(
    store: dist.Store, node: NodeInfo, is_host: bool, endpoint: str, timeout_s: float
) -> ClusterError:
    """The error for a rendezvous that did not complete: flags that disagree, or who is missing.

    [Note: --nnodes disagreement] torch's rendezvous never completes when the nodes pass
    different ``--nnodes`` (each waits for its own count). So every node leaves its flags in the
    store before joining (a "hello"), and the node that finds a disagreement closes the
    rendezvous, which ends the others' join loop at once; each node then reads the hellos here.
    The hosting node waits a moment before its store goes away with it, so that the others can.
    """
    try:
        seen = _hellos(store)
    except (RuntimeError, TimeoutError):
        return ClusterError(
            f"node {node.addr} lost the rendezvous store at {endpoint} while waiting for the "
            "other nodes; see the error printed on the node that hosts it"
        )
    if is_host:
        time.sleep(min(5.0, timeout_s / 3))
    clash = _nnodes_clash(seen)
    if clash is not None:
        return clash
    addrs = ", ".join(n.addr for n in seen) or "none"
    return ClusterError(
        f"rendezvous at {endpoint}: {len(seen)} of {node.nnodes} nodes arrived within "
        f"{timeout_s:g} s (seen: {addrs}): start the missing nodes with the same "
        "--rdzv-endpoint and --nnodes"
    )


def hosts_note(nproc: int) -> str:
    """Which host holds which global ranks, after a round (for failure messages)."""
    if not LAST_NODES:
        return ""
    parts = [
        f"node {n.node_rank} = {n.addr}, ranks {n.node_rank * nproc}-{(n.node_rank + 1) * nproc - 1}"
        for n in LAST_NODES
    ]
    return f" (hosts: {'; '.join(parts)})"


def _checked_rounds(
    handler: DynamicRendezvousHandler,
    raw_store: dist.Store,
    node: NodeInfo,
    is_host: bool,
    endpoint: str,
    timeout_s: float,
    guard: NodeGuard | None,
) -> Callable[[], RendezvousInfo]:
    """``handler.next_rendezvous`` with clear timeouts, the node check and the node rank kept."""
    first_round = handler.next_rendezvous

    def next_rendezvous() -> RendezvousInfo:
        _say_hello(raw_store, node)
        if _nnodes_clash(_hellos(raw_store)) is not None:  # [Note: --nnodes disagreement]
            handler.set_closed()
            raise _join_failed(raw_store, node, is_host, endpoint, timeout_s)
        try:
            info = first_round()
        except (RendezvousTimeoutError, RendezvousClosedError):
            raise _join_failed(raw_store, node, is_host, endpoint, timeout_s) from None
        store = info.store  # a store prefixed with this round: keys do not leak across rounds
        keys = [f"polytrain/node/{r}" for r in range(info.world_size)]
        store.set(keys[info.rank], node.encode())
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout_s))
            nodes = [NodeInfo.decode(raw) for raw in store.multi_get(keys)]
        except (RuntimeError, TimeoutError) as exc:
            raise ClusterError(
                f"node {node.addr} lost the rendezvous store at {endpoint} while checking the "
                f"nodes ({type(exc).__name__}); see the error printed on the other nodes"
            ) from None
        store.set(f"polytrain/checked/{info.rank}", "1")
        if is_host:
            # Keep the store up until every node has read the others, so that an error below
            # reaches every node as the same ClusterError rather than a lost connection.
            done = [f"polytrain/checked/{r}" for r in range(info.world_size)]
            try:
                store.wait(done, datetime.timedelta(seconds=min(timeout_s, 30.0)))
            except (RuntimeError, TimeoutError):
                pass
        check_nodes(nodes)
        LAST_NODES[:] = sorted(nodes, key=lambda n: n.node_rank)
        if guard is not None:
            guard.start()  # [Note: lost node] in launch/node_guard.py
        assert info.bootstrap_store_info is not None  # torch sets it when sharing its store
        return RendezvousInfo(store, node.node_rank, info.world_size, info.bootstrap_store_info)

    return next_rendezvous


def register() -> None:
    """Make ``rdzv_backend = "polytrain-c10d"`` available to the elastic launcher."""
    rendezvous_handler_registry.register(BACKEND, _create)


def node_address(endpoint: str) -> str:
    """This node's address towards the rendezvous ``endpoint`` (``HOST:PORT``)."""
    host, port = parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_PORT)
    return local_address(resolve(host), port)


def rdzv_configs(launch: LaunchConfig) -> dict[str, int]:
    """The rendezvous parameters of one node of a multi-node job (`_create` reads them).

    Joining, store reads and the node check all wait at most ``launch.timeout_s``, so a
    missing node or an unreachable endpoint is reported within the collective timeout.
    """
    timeout = max(1, int(launch.timeout_s))
    return {
        "node_rank": launch.node_rank,
        "join_timeout": timeout,
        "read_timeout": timeout,
    }

"""A rendezvous for one-node runs whose key-value stores listen on 127.0.0.1 only.

[Note: loopback rendezvous] torch's ``TCPStore`` server binds to every interface (``::`` /
``0.0.0.0``) whatever host name it is given; the host only tells clients where to connect. The
elastic agent starts two of them: the c10d rendezvous store and the store it shares with the
workers (``TORCHELASTIC_USE_AGENT_STORE``). Either would accept unauthenticated connections
from any host that can reach the machine, and a client can read and overwrite every key. For a
local run we therefore create both stores on a socket we bind to 127.0.0.1 ourselves and hand to
``TCPStore`` through ``master_listen_fd``. Gloo's own connections are pinned to the loopback
interface by ``GLOO_SOCKET_IFNAME=lo`` (launch/local.py). Multi-node runs use torch's ``c10d``
backend unchanged; docs/reliability.md says what that exposes.
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    create_handler,
)

from polytrain._torch_private import forget_shared_store, set_store_server_factory

__all__ = ["BACKEND", "listening_store", "loopback_store", "register"]

BACKEND = "polytrain-loopback"
HOST = "127.0.0.1"


def loopback_store(timeout_s: float = 900.0, port: int = 0) -> dist.TCPStore:
    """A ``TCPStore`` server listening on 127.0.0.1 only, on ``port`` (0: a free one)."""
    return listening_store(HOST, port, timeout_s)


def listening_store(addr: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A ``TCPStore`` server on a socket bound to ``addr:port`` only (torch's own binds every
    interface); ``port`` 0 takes a free one. Raises ``OSError`` if the address cannot be bound."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((addr, port))
    except OSError:
        sock.close()
        raise
    sock.listen(1024)
    return dist.TCPStore(
        addr,
        sock.getsockname()[1],
        is_master=True,
        wait_for_workers=False,
        multi_tenant=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        master_listen_fd=sock.detach(),  # the store owns the socket from here on
        use_libuv=True,
    )


class _Backend(C10dRendezvousBackend):
    """torch's c10d rendezvous state machine, under our backend name."""

    @property
    def name(self) -> str:
        return BACKEND


def _create(params: RendezvousParameters) -> DynamicRendezvousHandler:
    _, _, port = (params.endpoint or "").rpartition(":")
    store = loopback_store(port=int(port) if port.isdigit() else 0)  # the port the user named
    handler = create_handler(store, _Backend(store, params.run_id), params)

    def shared_server(master_addr: str, master_port: int) -> dist.TCPStore:
        return loopback_store()

    first_round = handler.next_rendezvous

    def next_rendezvous() -> RendezvousInfo:
        # A fresh shared store for every round: torch keeps the first one, so restarted
        # workers would find the dead workers' gloo addresses under the same keys.
        forget_shared_store(handler)
        return first_round()

    # The agent's second store (shared with the workers) is made by this method; it is the
    # one extension point torch offers for it.
    set_store_server_factory(handler, shared_server)
    handler.next_rendezvous = next_rendezvous  # type: ignore[method-assign]
    return handler


def register() -> None:
    """Make ``rdzv_backend = "polytrain-loopback"`` available to the elastic launcher."""
    rendezvous_handler_registry.register(BACKEND, _create)

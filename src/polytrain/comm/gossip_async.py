"""The wire of asynchronous gossip: mailboxes to and from peers that never make a rank wait.

[Note: asynchronous mailboxes] The training thread never waits for a peer. For each peer it
may send to there is a sender thread with a one-message slot: `Mailboxes.post` puts the newest
parameter copy there (replacing one not yet taken: a slow peer gets fewer, fresher copies) and
the thread sends it with `ps_wire.post_send` and waits. For each peer it may hear from there is
a receiver thread that keeps one receive posted and parks each arrival in an inbox slot (the
newest wins); `Mailboxes.take` empties the inboxes without blocking. Waits happen only on these
threads, because a gloo receive reports completion only to whoever waits on it
([Note: no timeouts on gloo waits] in `polytrain.comm.ps_wire`), so it cannot be polled.

A message is one flat tensor: the payload in the wire dtype, then the sender's step as the bits
of one int32 (one fp32 element, or two fp16/bf16 ones, never computed on), on its own tag
(`TAG_GOSSIP`); one sender thread per ordered pair, so a pair's messages arrive in order.

[Note: finished or dead] A rank that ends its training calls `Mailboxes.finish`: each sender
thread sends what is still in its slot, then a goodbye (a message whose step is -1), and the
rank waits (bounded) for its threads, i.e. for a goodbye or a closed connection from each peer
it hears from. A receiver whose peer's connection closes *without* a goodbye has lost a peer
that left (killed, crashed): the loss, with the peer's last step heard and the time, is queued
for the training thread (`Mailboxes.departures`), which reports it. A live peer that is only
slow or stopped keeps its connection: its threads wait, nobody else does (until the end, where
`finish` waits at most its timeout). Waiting for the threads at the end is not a nicety: a
daemon thread whose gloo wait returns while the interpreter shuts down is unwound through
C++ and aborts the process ("terminate called without an active exception").

Bytes are counted where they are sent: each sender thread adds the size of the tensor it hands
to c10d, and `Mailboxes.sent_bytes` returns the count since the last call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from polytrain.comm.gossip_wire import nbytes
from polytrain.comm.ps_wire import PeerLost, post_recv, post_send

__all__ = ["TAG_GOSSIP", "Departure", "Mailboxes", "with_step"]

_BYE = -1  # the step of a goodbye message

TAG_GOSSIP = 21
"""Asynchronous gossip messages (parameter copies, the sender's step as the last element)."""


def with_step(payload: torch.Tensor, step: int) -> torch.Tensor:
    """``payload`` followed by ``step`` as the bits of one int32 (the message format)."""
    return torch.cat([payload, torch.tensor([step], dtype=torch.int32).view(payload.dtype)])


def _step_of(message: torch.Tensor) -> int:
    tail = 4 // message.element_size()
    return int(message[-tail:].clone().view(torch.int32)[0])  # a copy: aligned for the view


@dataclass(frozen=True)
class Departure:
    """A peer that left without finishing: its rank, the last step heard from it, when."""

    rank: int
    last_step: int  # -1: nothing was heard from it
    seconds: float  # since the mailboxes opened
    detail: str


class Mailboxes:
    """Sender and receiver threads for asynchronous gossip ([Note: asynchronous mailboxes])."""

    def __init__(
        self, out_peers: Iterable[int], in_peers: Iterable[int], numel: int, dtype: torch.dtype
    ) -> None:
        # A message: ``numel`` payload elements in ``dtype``, then the step ([with_step]).
        self.numel, self.dtype = numel + 4 // dtype.itemsize, dtype
        self.start = time.monotonic()
        self._lock = threading.Condition()
        self._outbox: dict[int, torch.Tensor | None] = {}
        self._inbox: dict[int, torch.Tensor] = {}
        self._heard: dict[int, int] = {}  # peer -> last step received
        self._gone: set[int] = set()  # finished or departed peers
        self._departures: list[Departure] = []
        self._sent = 0
        self._finishing = False
        self._threads: list[threading.Thread] = []
        for peer in sorted(set(out_peers)):
            self._outbox[peer] = None
            self._spawn(self._send_loop, peer, "send")
        for peer in sorted(set(in_peers)):
            self._spawn(self._recv_loop, peer, "recv")

    def _spawn(self, target: Callable[[int], None], peer: int, kind: str) -> None:
        name = f"gossip-{kind}-{peer}"
        thread = threading.Thread(target=target, args=(peer,), name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    # -- the training thread's side --------------------------------------------------------

    def post(self, peer: int, message: torch.Tensor) -> None:
        """Queue ``message`` for ``peer``, replacing a copy not sent yet (no wait)."""
        with self._lock:
            if peer in self._outbox:
                self._outbox[peer] = message
                self._lock.notify_all()

    def take(self) -> dict[int, torch.Tensor]:
        """The messages (step bits included) that arrived since the last call, newest per
        peer (no wait)."""
        with self._lock:
            fresh, self._inbox = self._inbox, {}
        return fresh

    def departures(self) -> list[Departure]:
        """Peers that left without finishing since the last call ([Note: finished or dead])."""
        with self._lock:
            out, self._departures = self._departures, []
        return out

    def sent_bytes(self) -> int:
        """Bytes the sender threads handed to c10d since the last call."""
        with self._lock:
            sent, self._sent = self._sent, 0
        return sent

    def finish(self, timeout_s: float) -> list[int]:
        """Send the last copies and goodbyes, then wait up to ``timeout_s`` for every thread
        ([Note: finished or dead]); returns the peers whose threads are still waiting."""
        with self._lock:
            self._finishing = True
            self._lock.notify_all()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return sorted({int(t.name.rsplit("-", 1)[1]) for t in self._threads if t.is_alive()})

    # -- the threads -----------------------------------------------------------------------

    def _lost(self, peer: int, exc: PeerLost, *, report: bool) -> None:
        with self._lock:
            self._outbox.pop(peer, None)
            self._lock.notify_all()
            if not report or peer in self._gone:
                return
            self._gone.add(peer)
            seconds = time.monotonic() - self.start
            self._departures.append(Departure(peer, self._heard.get(peer, -1), seconds, str(exc)))

    def _send_loop(self, peer: int) -> None:
        bye = with_step(torch.zeros(self.numel - 4 // self.dtype.itemsize, dtype=self.dtype), _BYE)
        while True:
            with self._lock:
                while not self._finishing and self._outbox.get(peer) is None:
                    if peer not in self._outbox:  # the connection failed
                        return
                    self._lock.wait()
                if peer not in self._outbox:
                    return
                message = self._outbox[peer]
                self._outbox[peer] = None
            last = message is None  # finishing, nothing left: say goodbye
            try:
                op = post_send(bye if message is None else message, peer, TAG_GOSSIP)
                if message is not None:
                    with self._lock:
                        self._sent += nbytes(message)
                op.wait()
            except PeerLost as exc:  # reported by the receiving side, if there is one
                self._lost(peer, exc, report=False)
                return
            if last:
                return

    def _recv_loop(self, peer: int) -> None:
        while True:
            buffer = torch.empty(self.numel, dtype=self.dtype)
            try:
                post_recv(buffer, peer, TAG_GOSSIP).wait()
            except PeerLost as exc:
                self._lost(peer, exc, report=True)
                return
            step = _step_of(buffer)
            with self._lock:
                if step == _BYE:
                    self._gone.add(peer)
                    return
                self._inbox[peer] = buffer
                self._heard[peer] = step

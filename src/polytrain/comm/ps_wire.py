"""The parameter server's c10d point-to-point calls: header + payload messages on fixed tags.

Everything the parameter server sends goes through here (ARCHITECTURE layering: only comm/
calls c10d). A message is an encoded `polytrain.ps.protocol.Header` (int64) on a header tag,
followed for payload ops by one flat tensor on the matching payload tag. Tags keep the two
apart, so a server's receiver for one worker waits for headers and payloads separately, and
payloads always match their header: messages between two ranks on one tag arrive in the order
they were posted. (Receiving from *any* source is avoided: once one peer's connection breaks,
every later receive-from-any fails too.)

[Note: no timeouts on gloo waits] A gloo ``wait(timeout)`` that expires leaves its receive
posted (it later swallows a message meant for someone else) and closes the pair it waited on.
So nothing here waits with a timeout. Liveness is learnt from the transport instead: a peer
whose process died has a closed connection, and posting a receive from it fails at once
(`peer_is_gone`); a receive from a live peer on the probe tag, which nobody sends on, just stays
posted. Every failure of an operation with a known peer is raised as `PeerLost` naming it.
Waits pass an explicit week-long timeout: without one gloo applies the process group's timeout
(``launch.timeout_s``) and an idle server (every worker busy computing) would close its pairs.

[Note: hung server] A server whose process is alive but no longer serves (stuck main
thread, stopped process) keeps its connections open, so `peer_is_gone` cannot see it and a
worker waiting for its reply would wait a week. Every server therefore increments a heartbeat
counter in the c10d store (`heartbeat`) about twice a second while it serves, and a worker
waits for a reply through `wait_all_watched`: a daemon thread does the blocking gloo wait (a
wait with a timeout would close the pair, see above; ``Work.is_completed`` of a gloo receive
stays False until someone waits) while the worker checks the server's counter; a counter that
has not moved for ``launch.timeout_s`` raises `PeerHung` naming the server. A server that is
only busy (waiting for a slow worker before it grants a pull) keeps beating, so it is never
mistaken for a hung one.

[Note: payload guard] Gloo cannot tell a receiver how long a message was: a shorter message
fills the front of the buffer silently, and a longer one aborts the receiving process inside
gloo. Payloads are therefore received into a buffer one element longer than the header
announced, whose last announced element and guard element are pre-filled with a NaN bit
pattern no sane sender produces: a short payload leaves the last element unwritten, a payload
one element too long overwrites the guard; `check_guarded` turns either into a `ProtocolError`
before anything is applied. A payload two or more elements longer than announced still aborts
the receiver in gloo (documented limit).
"""

from __future__ import annotations

import datetime
import math
import os
import queue
import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from polytrain.comm.watchdog import default_store
from polytrain.errors import ProtocolError

__all__ = [
    "LINK_PROBE_BYTES",
    "TAG_LINK",
    "TAG_LINK_DATA",
    "TAG_PARAMS",
    "TAG_PROBE",
    "TAG_PUSH",
    "TAG_REPLY",
    "TAG_REQUEST",
    "Group",
    "PeerHung",
    "PeerLost",
    "all_reduce_sum",
    "arm_guard",
    "broadcast",
    "check_guarded",
    "guarded_buffer",
    "heartbeat",
    "peer_is_gone",
    "post_recv",
    "post_send",
    "probe_link",
    "wait_all",
    "wait_all_watched",
    "world_group",
]

_FOREVER = datetime.timedelta(days=7)

Group = dist.ProcessGroup | None
"""A world-sized group for point-to-point traffic (None: the default group). Colocated
servers each talk over their own copy of the world ([Note: colocated servers] in
polytrain.ps.local), so a rank's server and worker never share a gloo pair."""

TAG_REQUEST = 11
"""Worker -> server headers (PULL, PUSH, CLOCK, JOIN, LEAVE, SHUTDOWN)."""
TAG_PUSH = 12
"""Worker -> server payloads (gradient chunks)."""
TAG_REPLY = 13
"""Server -> worker headers (ACK, PARAMS, SHUTDOWN, ERROR)."""
TAG_PARAMS = 14
"""Server -> worker payloads (parameter chunks)."""
TAG_PROBE = 15
"""Never sent on: a receive posted here fails at once if and only if the peer is gone."""
TAG_LINK = 16
"""Start-up link probe (`probe_link`): the next message size, 0 to stop."""
TAG_LINK_DATA = 17
"""Start-up link probe: the timed messages and their echoes."""

LINK_PROBE_BYTES = (16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
"""Message sizes `probe_link` times, smallest first."""
LINK_PROBE_TRIPS = 5
"""Round trips per probe size, the first a warm-up."""
LINK_PROBE_SLOW_S = 0.05
"""A round trip longer than this ends the probe: on so slow a link larger messages add time,
not information (the rate is already the link's)."""


class PeerLost(RuntimeError):
    """A point-to-point operation with ``peer`` failed: its process died or its link broke."""

    def __init__(self, peer: int, detail: str) -> None:
        super().__init__(f"lost rank {peer}: {detail.splitlines()[0] if detail else ''}")
        self.peer = peer


class PeerHung(Exception):
    """A live peer sent no reply and showed no sign of work for ``launch.timeout_s``.

    Not a `RuntimeError`: it names the peer already, so the loop's watchdog (which turns
    RuntimeErrors of failed collectives into a list of missing ranks) lets it through.
    """


class _Op:
    """A posted send or receive with its peer, so a failure names the peer."""

    def __init__(self, work: dist.Work | None, peer: int, keep: torch.Tensor) -> None:
        self.work, self.peer, self.keep = work, peer, keep

    def wait(self) -> None:
        if self.work is None:
            return
        try:
            self.work.wait(timeout=_FOREVER)
        except RuntimeError as exc:
            raise PeerLost(self.peer, str(exc)) from None


def post_send(tensor: torch.Tensor, dst: int, tag: int, group: Group = None) -> _Op:
    """Start sending ``tensor`` to global rank ``dst`` on ``tag`` (over ``group``, a world-sized
    group, default the world); keep the result until `wait_all`."""
    try:
        return _Op(dist.isend(tensor, dst=dst, tag=tag, group=group), dst, tensor)
    except RuntimeError as exc:
        raise PeerLost(dst, str(exc)) from None


def post_recv(tensor: torch.Tensor, src: int, tag: int, group: Group = None) -> _Op:
    """Start receiving into ``tensor`` from global rank ``src`` on ``tag`` (over ``group``)."""
    try:
        return _Op(dist.irecv(tensor, src=src, tag=tag, group=group), src, tensor)
    except RuntimeError as exc:
        raise PeerLost(src, str(exc)) from None


def wait_all(ops: Sequence[_Op]) -> None:
    """Wait for every op; the first failure is raised (as `PeerLost`) after all were waited."""
    first: PeerLost | None = None
    for op in ops:
        try:
            op.wait()
        except PeerLost as exc:
            first = first or exc
    if first is not None:
        raise first


def probe_link(peer: int, lead: bool) -> list[tuple[float, float]]:
    """One-way seconds per message size between this rank and ``peer`` (both call it, one with
    ``lead``), for the automatic chunk size ([Note: chunk size from the link] in
    polytrain.ps.layout). The leading side announces each size of `LINK_PROBE_BYTES` on
    `TAG_LINK`, then times `LINK_PROBE_TRIPS` round trips of it (the peer echoes each message)
    and keeps the fastest after the first (a warm-up): one slow trip on a busy host would
    otherwise move the chunk size; it stops after a round trip longer than `LINK_PROBE_SLOW_S`, and
    returns ``(bytes, seconds)`` points. The echoing side returns []."""
    size = torch.zeros(1, dtype=torch.int64)
    points: list[tuple[float, float]] = []
    for nbytes in LINK_PROBE_BYTES if lead else iter(int, 1):
        if lead:
            size.fill_(nbytes)
            wait_all([post_send(size, peer, TAG_LINK)])
        else:
            wait_all([post_recv(size, peer, TAG_LINK)])
            nbytes = int(size.item())
            if nbytes == 0:
                return points
        buf = torch.zeros(max(nbytes // 4, 1))
        best = math.inf
        for trip in range(LINK_PROBE_TRIPS):
            if lead:
                start = time.perf_counter()
                echo = post_recv(buf, peer, TAG_LINK_DATA)
                wait_all([post_send(buf, peer, TAG_LINK_DATA), echo])
                if trip > 0:
                    best = min(best, time.perf_counter() - start)
            else:
                wait_all([post_recv(buf, peer, TAG_LINK_DATA)])
                wait_all([post_send(buf, peer, TAG_LINK_DATA)])
        if lead:
            points.append((float(nbytes), best / 2))
            if best > LINK_PROBE_SLOW_S:
                break
    size.zero_()
    wait_all([post_send(size, peer, TAG_LINK)])
    return points


def _beat_key(name: str) -> str:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"polytrain/ps/{attempt}/beat/{name}"


_BEAT_EVERY_S = 0.5
_last_beat: dict[str, float] = {}


def heartbeat(name: str) -> None:
    """Tell waiting peers that ``name`` (e.g. ``server0``) is serving ([Note: hung server]).

    Cheap to call often: the store is written at most every `_BEAT_EVERY_S` seconds.
    """
    store = default_store()
    now = time.monotonic()
    if store is None or now - _last_beat.get(name, -1e9) < _BEAT_EVERY_S:
        return
    _last_beat[name] = now
    store.add(_beat_key(name), 1)


_Request = tuple[Sequence[_Op], list[BaseException], threading.Event]


class _Waiter:
    """A daemon thread that runs the blocking waits handed to it ([Note: hung server])."""

    def __init__(self) -> None:
        self.requests: queue.Queue[_Request] = queue.Queue()
        threading.Thread(target=self._run, name="ps-wait", daemon=True).start()

    def _run(self) -> None:
        while True:
            ops, errors, done = self.requests.get()
            try:
                wait_all(ops)
            except BaseException as exc:  # handed to the waiting thread, which raises it
                errors.append(exc)
            done.set()


_waiter: list[_Waiter] = []  # at most one per process, started on first use


def wait_all_watched(ops: Sequence[_Op], peer: int, name: str, timeout_s: float, what: str) -> None:
    """`wait_all` for replies from ``peer``, whose heartbeat is ``name``: raise `PeerHung`
    if they have not come and the heartbeat has not moved for ``timeout_s`` seconds."""
    store = default_store()
    if store is None or not ops:
        wait_all(ops)
        return
    if not _waiter:
        _waiter.append(_Waiter())
    errors: list[BaseException] = []
    done = threading.Event()
    _waiter[0].requests.put((ops, errors, done))
    key = _beat_key(name)
    beats, since = -1, time.monotonic()
    while not done.wait(timeout=min(1.0, timeout_s / 4)):
        now_beats = int(store.add(key, 0))
        if now_beats != beats:
            beats, since = now_beats, time.monotonic()
        elif time.monotonic() - since > timeout_s:
            raise PeerHung(
                f"rank {peer} ({name}) did not answer {what} within launch.timeout_s = "
                f"{timeout_s:g} s and stopped serving (its process is alive, its heartbeat "
                f"stopped): see rank {peer}'s log, or raise --timeout if it is only slow"
            )
    if errors:
        raise errors[0]


def peer_is_gone(peer: int, group: Group = None) -> bool:
    """Whether ``peer``'s process is gone (its connection is closed); see the module note.

    A live peer leaves one small receive posted on `TAG_PROBE`; call this rarely.
    """
    try:
        work = dist.irecv(torch.zeros(1, dtype=torch.uint8), src=peer, tag=TAG_PROBE, group=group)
    except RuntimeError:
        return True
    if work is not None:
        _PROBES.append(work)  # keep the posted receive (and its buffer) alive
    return False


_PROBES: list[dist.Work] = []


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """In-place sum over ``group`` (hierarchical reduction within a host, norms over servers)."""
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, group=group)


def world_group() -> dist.ProcessGroup:
    """The default (world) group, for the few start-up collectives over every rank."""
    group = dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup), "torch.distributed is not initialised"
    return group


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup) -> None:
    """In-place broadcast from global rank ``src`` over ``group``."""
    if dist.get_world_size(group) > 1:
        dist.broadcast(tensor, src=src, group=group)


_GUARD_BITS = {torch.float32: 0x7FA5A5A5, torch.float64: 0x7FF4A5A5A5A5A5A5}


def guarded_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A receive buffer of ``numel + 1`` elements with the guard pattern ([Note: payload guard])."""
    buf = torch.zeros(numel + 1, dtype=dtype)
    arm_guard(buf)
    return buf


def arm_guard(window: torch.Tensor) -> None:
    """Write the guard pattern into the last two elements of ``window`` (``numel + 1`` long).

    Lets a receive land in place in a larger buffer (a server's staging buffer) instead of a
    fresh `guarded_buffer`: the element after the payload is borrowed as the guard.
    """
    bits = _GUARD_BITS.get(window.dtype)
    if bits is not None:
        int_dtype = torch.int32 if window.dtype.itemsize == 4 else torch.int64
        window[-2:].view(int_dtype).fill_(bits)


def check_guarded(buf: torch.Tensor, src: int) -> torch.Tensor:
    """The payload (a view without the guard) if its length was as announced, else raise."""
    bits = _GUARD_BITS.get(buf.dtype)
    if bits is not None:
        int_dtype = torch.int32 if buf.dtype.itemsize == 4 else torch.int64
        last, guard = buf[-2:].view(int_dtype).tolist()
        if guard != bits:
            raise ProtocolError(
                f"payload from rank {src} is longer than its header field numel = "
                f"{buf.numel() - 1}: the message was rejected and nothing was applied"
            )
        if last == bits:
            raise ProtocolError(
                f"payload from rank {src} is shorter than its header field numel = "
                f"{buf.numel() - 1}: the message was rejected and nothing was applied"
            )
    return buf[:-1]

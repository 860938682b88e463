"""Tensor-only wire format of the parameter server: a fixed int64 header, then a payload tensor.

Workers and servers talk over c10d point-to-point (ARCHITECTURE: no sockets, no pickle). Every
message is one `Header` encoded as an int64 tensor of `HEADER_LEN` elements, followed (for ops
in `PAYLOAD_OPS`) by one flat payload tensor of ``header.numel`` elements of dtype
``header.dtype``. Large buffers travel as several chunks so that sending chunk ``k + 1`` overlaps
applying chunk ``k`` (PAI's pipelined chunked communication; the push/pull interface of Li et
al., "Scaling Distributed Machine Learning with the Parameter Server", OSDI 2014; the sharded
server of Dean et al., "Large Scale Distributed Deep Networks" (DistBelief), NIPS 2012).

[Note: validate before use] A receiver never trusts a header: `Header.decode` checks length,
dtype, magic, version, job fingerprint, op, ranges and sizes, and raises `ProtocolError` naming
the field before the runtime reads any field or applies any payload. `Header.check_payload`
does the same for the payload tensor. A message from another job (another model or layout) is
rejected by its `job_id`, a 63-bit fingerprint from `job_fingerprint`.

Header layout (one int64 per slot, in this order)::

    magic  version  op  worker  clock  shard  chunk  num_chunks  numel  dtype  job_id
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass, fields
from enum import IntEnum

import torch

from polytrain.errors import ProtocolError

__all__ = [
    "DTYPE_CODES",
    "DTYPE_NONE",
    "HEADER_FIELDS",
    "HEADER_LEN",
    "MAGIC",
    "PAYLOAD_OPS",
    "PROTOCOL_VERSION",
    "Header",
    "Op",
    "chunk_spans",
    "dtype_code",
    "dtype_from_code",
    "job_fingerprint",
]

MAGIC: int = int.from_bytes(b"POLYTRPS", "big")
"""First header slot; anything else is not a polytrain parameter-server message."""

PROTOCOL_VERSION: int = 1
"""Bump when the header layout or an op's meaning changes."""

_MAX_INT63 = (1 << 63) - 1


class Op(IntEnum):
    """What a message means. Direction in brackets: W = worker, S = server."""

    PUSH = 1
    """[W->S] a gradient chunk of clock ``clock`` for shard ``shard``."""
    PULL = 2
    """[W->S] request the parameters of shard ``shard``; ``clock`` is the worker's clock."""
    PARAMS = 3
    """[S->W] a parameter chunk of shard ``shard`` at version ``clock``."""
    CLOCK = 4
    """[W->S] the worker finished clock ``clock`` (all its pushes of that clock are sent)."""
    JOIN = 5
    """[W->S] a worker joins the job (elastic membership)."""
    LEAVE = 6
    """[W->S] a worker leaves; the server stops waiting for it."""
    ACK = 7
    """[S->W] the request with the same op-specific fields was accepted."""
    SHUTDOWN = 8
    """[W->S or S->W] stop serving; the receiver exits its loop."""
    ERROR = 9
    """[either] the peer rejected the previous message; details are in the peer's log."""


PAYLOAD_OPS: frozenset[Op] = frozenset({Op.PUSH, Op.PARAMS})
"""Ops followed by a payload tensor; every other op has ``numel == 0`` and no payload."""

DTYPE_NONE: int = 0
"""Dtype code of a message without payload."""

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.int64: 5,
}
"""Payload dtype -> header code. Codes are part of the wire format: never renumber."""

_DTYPES_BY_CODE: dict[int, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    """Wire code of a payload dtype."""
    if dtype not in DTYPE_CODES:
        supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
        raise ProtocolError(
            f"payload dtype {dtype} cannot be sent: expected one of {supported}; "
            f"cast the buffer before sending"
        )
    return DTYPE_CODES[dtype]


def dtype_from_code(code: int) -> torch.dtype:
    """Payload dtype of a wire code (`DTYPE_NONE` has no dtype and is an error here)."""
    if code not in _DTYPES_BY_CODE:
        raise ProtocolError(
            f"header field dtype = {code}: expected a payload dtype code in "
            f"{sorted(_DTYPES_BY_CODE)}"
        )
    return _DTYPES_BY_CODE[code]


@dataclass(frozen=True)
class Header:
    """One message header; `encode` gives its wire tensor, `decode` validates and parses one.

    ``worker`` is the worker slot the message concerns: the sender of a worker->server message,
    the addressee of a server->worker reply. ``clock`` is the worker's logical clock (number of
    completed iterations) or, in `Op.PARAMS`, the version of the parameters sent.
    """

    op: Op
    worker: int
    clock: int
    job_id: int
    shard: int = 0
    chunk: int = 0
    num_chunks: int = 1
    numel: int = 0
    dtype: int = DTYPE_NONE
    magic: int = MAGIC
    version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ProtocolError(
                    f"header field {f.name} = {value!r}: expected an int, got {type(value).__name__}"
                )
        if not isinstance(self.op, Op):
            object.__setattr__(self, "op", _parse_op(self.op))
        _check_context_free(self)

    @property
    def payload_dtype(self) -> torch.dtype | None:
        """Torch dtype of the payload, or None for a message without payload."""
        return None if self.dtype == DTYPE_NONE else dtype_from_code(self.dtype)

    def encode(self) -> torch.Tensor:
        """The wire tensor: int64, shape ``(HEADER_LEN,)``, slots in `HEADER_FIELDS` order."""
        return torch.tensor([int(getattr(self, name)) for name in HEADER_FIELDS], dtype=torch.int64)

    @classmethod
    def decode(
        cls,
        t: torch.Tensor,
        *,
        expect_job: int,
        num_workers: int,
        num_shards: int,
        expect_numel: int | None = None,
        expect_ops: Collection[Op] | None = None,
    ) -> Header:
        """Parse and validate a received header; raise `ProtocolError` naming the bad field.

        ``num_workers`` and ``num_shards`` bound ``worker`` and ``shard``; ``expect_numel``
        (when given) is the exact payload size the receiver expects for this chunk;
        ``expect_ops`` (when given) are the ops the receiver accepts at this point.
        """
        values = _check_tensor(t)
        by_name = dict(zip(HEADER_FIELDS, values, strict=True))
        if by_name["magic"] != MAGIC:
            raise ProtocolError(
                f"header field magic = {by_name['magic']:#x}: expected {MAGIC:#x}; the sender is "
                f"not a polytrain parameter-server peer or the stream is out of step"
            )
        if by_name["version"] != PROTOCOL_VERSION:
            raise ProtocolError(
                f"header field version = {by_name['version']}: expected protocol version "
                f"{PROTOCOL_VERSION}; run the same polytrain version on every rank"
            )
        if by_name["job_id"] != expect_job:
            raise ProtocolError(
                f"header field job_id = {by_name['job_id']:#x}: expected {expect_job:#x}; the "
                f"peer belongs to another job (different model, dtypes or layout)"
            )
        op = _parse_op(by_name["op"])
        if expect_ops is not None and op not in expect_ops:
            names = ", ".join(sorted(o.name for o in expect_ops))
            raise ProtocolError(f"header field op = {op.name}: expected one of {names} here")
        _check_range("worker", by_name["worker"], num_workers, "num_workers")
        _check_range("shard", by_name["shard"], num_shards, "num_shards")
        header = cls(
            op=op,
            worker=by_name["worker"],
            clock=by_name["clock"],
            job_id=by_name["job_id"],
            shard=by_name["shard"],
            chunk=by_name["chunk"],
            num_chunks=by_name["num_chunks"],
            numel=by_name["numel"],
            dtype=by_name["dtype"],
            magic=by_name["magic"],
            version=by_name["version"],
        )
        if expect_numel is not None and op in PAYLOAD_OPS and header.numel != expect_numel:
            raise ProtocolError(
                f"header field numel = {header.numel}: expected {expect_numel} elements for "
                f"shard {header.shard} chunk {header.chunk}/{header.num_chunks}"
            )
        return header

    def check_payload(self, payload: torch.Tensor) -> None:
        """Raise `ProtocolError` unless ``payload`` is what this header announces."""
        expected = self.payload_dtype
        if expected is None:
            raise ProtocolError(f"op {self.op.name} carries no payload, but a payload arrived")
        if payload.dtype != expected:
            raise ProtocolError(
                f"payload dtype = {payload.dtype}: expected {expected} (header field dtype)"
            )
        if payload.numel() != self.numel:
            raise ProtocolError(
                f"payload numel = {payload.numel()}: expected {self.numel} (header field numel)"
            )


HEADER_FIELDS: tuple[str, ...] = (
    "magic",
    "version",
    "op",
    "worker",
    "clock",
    "shard",
    "chunk",
    "num_chunks",
    "numel",
    "dtype",
    "job_id",
)
"""Wire order of the header slots."""

HEADER_LEN: int = len(HEADER_FIELDS)
"""Number of int64 slots in an encoded header."""

assert set(HEADER_FIELDS) == {f.name for f in fields(Header)}


def _parse_op(value: int) -> Op:
    try:
        return Op(value)
    except ValueError:
        valid = ", ".join(f"{o.name}={o.value}" for o in Op)
        raise ProtocolError(f"header field op = {value}: expected one of {valid}") from None


def _check_tensor(t: torch.Tensor) -> list[int]:
    if not isinstance(t, torch.Tensor):
        raise ProtocolError(f"header = {type(t).__name__}: expected an int64 tensor")
    if t.dtype != torch.int64:
        raise ProtocolError(f"header dtype = {t.dtype}: expected torch.int64")
    if t.dim() != 1 or t.numel() != HEADER_LEN:
        raise ProtocolError(
            f"header length = {tuple(t.shape)}: expected ({HEADER_LEN},); the message was "
            f"truncated or the peer speaks another protocol version"
        )
    values: list[int] = t.tolist()
    return values


def _check_range(name: str, value: int, bound: int, bound_name: str) -> None:
    if not 0 <= value < bound:
        raise ProtocolError(
            f"header field {name} = {value}: expected 0 <= {name} < {bound_name} = {bound}"
        )


def _check_context_free(h: Header) -> None:
    """Checks that need no knowledge of the receiver (see [Note: validate before use])."""
    if h.magic != MAGIC:
        raise ProtocolError(f"header field magic = {h.magic:#x}: expected {MAGIC:#x}")
    if h.version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"header field version = {h.version}: expected protocol version {PROTOCOL_VERSION}"
        )
    for name in ("worker", "clock", "shard", "chunk", "numel"):
        value = getattr(h, name)
        if value < 0:
            raise ProtocolError(f"header field {name} = {value}: expected a non-negative int")
    if not 0 <= h.job_id <= _MAX_INT63:
        raise ProtocolError(f"header field job_id = {h.job_id}: expected a 63-bit fingerprint")
    if h.num_chunks < 1:
        raise ProtocolError(f"header field num_chunks = {h.num_chunks}: expected >= 1")
    if h.chunk >= h.num_chunks:
        raise ProtocolError(
            f"header field chunk = {h.chunk}: expected chunk < num_chunks = {h.num_chunks}"
        )
    if h.op in PAYLOAD_OPS:
        if h.numel < 1:
            raise ProtocolError(
                f"header field numel = {h.numel}: op {h.op.name} carries a payload, expected >= 1"
            )
        dtype_from_code(h.dtype)
    else:
        if h.numel != 0:
            raise ProtocolError(
                f"header field numel = {h.numel}: op {h.op.name} carries no payload, expected 0"
            )
        if h.dtype != DTYPE_NONE:
            raise ProtocolError(
                f"header field dtype = {h.dtype}: op {h.op.name} carries no payload, "
                f"expected {DTYPE_NONE}"
            )


def job_fingerprint(
    param_shapes: Sequence[tuple[str, tuple[int, ...], str]], extra: str = ""
) -> int:
    """Deterministic 63-bit fingerprint of a job's parameters (name, shape, dtype) in order.

    Uses SHA-256 over a canonical JSON encoding, so every process and every Python run agrees
    (unlike ``hash``, which is salted per process). ``extra`` mixes in anything else both sides
    must agree on (layout, number of servers, ...).
    """
    canonical = json.dumps(
        [[name, [int(d) for d in shape], str(dtype)] for name, shape, dtype in param_shapes]
        + [extra],
        separators=(",", ":"),
        ensure_ascii=True,
    )
    digest = hashlib.sha256(canonical.encode("ascii")).digest()
    return int.from_bytes(digest[:8], "big") & _MAX_INT63


def chunk_spans(numel: int, chunk_elems: int) -> list[tuple[int, int]]:
    """Contiguous ``(start, stop)`` spans covering ``[0, numel)``, each ``chunk_elems`` long.

    The last span may be shorter; an empty buffer has no spans.
    """
    if chunk_elems < 1:
        raise ProtocolError(
            f"chunk_elems = {chunk_elems}: expected a positive number of elements per chunk; "
            f"raise ps.chunk_kb"
        )
    if numel < 0:
        raise ProtocolError(f"numel = {numel}: expected a non-negative buffer size")
    return [(start, min(start + chunk_elems, numel)) for start in range(0, numel, chunk_elems)]

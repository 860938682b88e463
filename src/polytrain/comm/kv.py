"""Small byte strings through the c10d store, for coordination off the collective transport.

Used where a background thread must tell rank 0 something (a checkpoint file is written, here is
its checksum) without issuing a collective that would interleave with the training thread's.
Values are raw bytes (JSON text by convention), never pickles.
"""

from __future__ import annotations

import datetime
import os

from polytrain._torch_private import default_store

__all__ = ["collect", "publish", "scoped"]


def scoped(key: str) -> str:
    """``key`` under this elastic attempt, so a restarted group never reads stale values."""
    return f"polytrain/kv/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{key}"


def publish(key: str, value: str) -> None:
    store = default_store()
    if store is not None:
        store.set(scoped(key), value)


def collect(keys: list[str], timeout_s: float) -> list[bytes]:
    """Wait until every key is set (at most ``timeout_s``), then return their values."""
    store = default_store()
    assert store is not None, "collect needs an initialised process group"
    full = [scoped(k) for k in keys]
    store.wait(full, datetime.timedelta(seconds=timeout_s))
    return [store.get(k) for k in full]

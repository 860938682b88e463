"""Run a function on N gloo ranks and carry each rank's result or traceback back to the caller.

Rendezvous is a ``file://`` store in a fresh temporary directory (no port races between tests),
every rank runs one compute thread, and a deadline turns a hang into a `TimeoutError` that names
the ranks that never reported. The deadline is given in seconds on an idle machine and stretched
by the machine's measured slowdown ([Note: deadlines scale with machine speed] in
`polytrain.testing.speed`). ``fn(rank, world_size, *args)`` must be importable at module
level: ranks start from a fork server, never by forking the caller ([Note: fork server]).

[Note: fork server] Each rank used to be a fresh ``spawn``: a new interpreter importing torch,
FSDP and DTensor, about 3.5 s of CPU per rank before its first line of work, which on CI's two
cores was the largest single cost of the test suite. Ranks now come from ``multiprocessing``'s
fork server with those modules preloaded: the server imports them once and each rank is a fork
of it (not of the caller, which may hold threads and process groups). Forking a process that
imported torch but started no threads and no process group is safe; ``_entry`` still sets
every rank's environment and its single compute thread itself.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from polytrain.testing.speed import scaled

__all__ = ["RankFailure", "run_distributed"]

# What the fork server imports once for every rank ([Note: fork server]). torch._dynamo: a
# torch optimizer imports it when it is built (its methods are wrapped by torch's lazy
# ``_disable_dynamo``), about 0.5 s of CPU per rank after the rest; importing it starts no thread.
PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "polytrain.trainer.loop",
]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (first use)
    return ctx


class RankFailure(RuntimeError):
    """A rank raised; the message carries its rank, exception and traceback."""


class _Array:
    """A tensor in transit as a numpy array. torch's own reducer would pass a shared-memory
    handle that dies with the child process; a numpy copy travels by value."""

    def __init__(self, array: Any) -> None:
        self.array = array


def _pack(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return _Array(value.detach().cpu().clone().numpy())
    if isinstance(value, dict):
        return {k: _pack(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_pack(v) for v in value)
    return value


def _unpack(value: Any) -> Any:
    import torch

    if isinstance(value, _Array):
        return torch.from_numpy(value.array)
    if isinstance(value, dict):
        return {k: _unpack(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_unpack(v) for v in value)
    return value


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    timeout_s: float,
    results: Any,
    args: tuple[Any, ...],
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        # init_process_group returns on one rank while gloo may still be finishing the mesh
        # on another: a rank whose ``fn`` returns at once would tear its end down under the
        # peer ("Connection closed by peer" in connectFullMesh). Every rank meets here first.
        dist.barrier()
        result = fn(rank, world_size, *args)
        results.put((rank, True, _pack(result)))
    except BaseException as exc:  # carried to the parent, which re-raises
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _crashed(procs: list[Any], ranks: list[int], wait_s: float) -> int | None:
    """The first of ``ranks`` whose process exited with a non-zero code, polling ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        dead = [r for r in ranks if procs[r].exitcode not in (None, 0)]
        if dead or time.monotonic() >= deadline:
            return dead[0] if dead else None
        time.sleep(0.05)


def _crash_message(procs: list[Any], rank: int) -> str:
    return (
        f"rank {rank} exited with code {procs[rank].exitcode} before reporting "
        "(see its stderr above)"
    )


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    collective_timeout_s: float = 60.0,
    scale_timeout: bool = True,
) -> list[Any]:
    """Run ``fn`` on ``world_size`` ranks; return the per-rank results in rank order.

    ``timeout_s`` bounds the whole run on an idle machine; the deadline used is
    ``scaled(timeout_s)`` (``timeout_s`` itself with ``scale_timeout=False``, for a deadline
    the caller measured). ``collective_timeout_s`` is the process group's own timeout, as given
    (tests of hang detection set it on purpose).
    """
    if scale_timeout:
        timeout_s = scaled(timeout_s)
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="polytrain-test-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_entry,
                args=(fn, rank, world_size, init_file, collective_timeout_s, results, args),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        try:
            while len(out) < world_size:
                remaining = (deadline - datetime.datetime.now()).total_seconds()
                try:
                    rank, ok, value = results.get(timeout=min(max(remaining, 0.01), 1.0))
                except queue.Empty:
                    missing = sorted(set(range(world_size)) - set(out))
                    # A rank that died without reporting (a crash at start-up, a signal)
                    # fails the run now rather than at the deadline.
                    dead = _crashed(procs, missing, wait_s=0.0)
                    if dead is not None:
                        raise RankFailure(_crash_message(procs, dead)) from None
                    if remaining <= 0:
                        raise TimeoutError(
                            f"ranks {missing} did not finish within {timeout_s:.0f} s"
                        ) from None
                    continue
                if not ok:
                    # A rank that crashed outright is the cause; the others' errors (a peer
                    # closed the connection) follow from it, and may arrive first. Waiting
                    # for its exit is a deadline too, scaled like the others.
                    others = sorted(set(range(world_size)) - set(out) - {rank})
                    dead = _crashed(procs, others, wait_s=scaled(1.0))
                    if dead is not None:
                        raise RankFailure(
                            f"{_crash_message(procs, dead)}; then rank {rank} failed: {value}"
                        )
                    raise RankFailure(f"rank {rank} failed: {value}")
                out[rank] = _unpack(value)
        finally:
            for p in procs:
                p.join(timeout=5 if len(out) == world_size else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [out[r] for r in range(world_size)]

"""The multi-process harness reports results, exceptions, crashes and hangs per rank."""

from __future__ import annotations

import os
import time

import pytest
import torch

from polytrain.testing import RankFailure, run_distributed, scaled

pytestmark = pytest.mark.slow


def _sum_of_ranks(rank: int, world_size: int) -> torch.Tensor:
    from polytrain.comm.collectives import all_reduce_mean

    t = torch.tensor([float(rank)])
    return all_reduce_mean(t) * world_size


def _raise_on_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one is broken")


def _crash_on_one(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    time.sleep(3600)  # until the harness kills it


def _fail_on_zero_while_one_crashes(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(0.3)  # the crash lands just after rank 0's report, as in a real race
        os._exit(3)
    raise RuntimeError("Connection closed by peer")


def _noop(rank: int, world_size: int) -> None:
    pass


def _hang_on_one(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(3600)  # until the harness kills it


def test_results_come_back_in_rank_order() -> None:
    out = run_distributed(_sum_of_ranks, 2)
    assert [float(t) for t in out] == [1.0, 1.0]


def test_exception_names_rank_and_carries_traceback() -> None:
    with pytest.raises(
        RankFailure, match=r"rank 1 failed: ValueError: rank one is broken(.|\n)*Traceback"
    ):
        run_distributed(_raise_on_one, 2)


def test_crashed_rank_fails_fast() -> None:
    # Rank 0 never finishes: a RankFailure rather than the deadline's TimeoutError shows the
    # crash ended the run (an order of events, not a wall-clock bound).
    with pytest.raises(RankFailure, match="rank 1 exited with code 3"):
        run_distributed(_crash_on_one, 2, timeout_s=60)


def test_the_crashed_rank_is_named_before_the_peer_it_took_down() -> None:
    """Rank 0's report arrives first, but a rank that crashes outright is named first."""
    with pytest.raises(
        RankFailure, match=r"rank 1 exited with code 3 .*; then rank 0 failed: RuntimeError"
    ):
        run_distributed(_fail_on_zero_while_one_crashes, 2, timeout_s=60)


def test_hang_becomes_timeout_naming_the_rank() -> None:
    """Only the hung rank is named. The deadline must outlast the healthy rank's start-up
    (spawn, import torch, gloo rendezvous), which a loaded machine stretches far more than CPU
    work: it is three times a measured start-up of the same world, and at least the 5 s of an
    idle machine, scaled ([Note: deadlines scale with machine speed])."""
    start = time.monotonic()
    run_distributed(_noop, 2)
    deadline = max(scaled(5.0), 3 * (time.monotonic() - start))
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^ranks \[1\] did not finish within \d+ s$"):
        run_distributed(_hang_on_one, 2, timeout_s=deadline, scale_timeout=False)
    assert time.monotonic() - start >= deadline  # it waited for the deadline, no less

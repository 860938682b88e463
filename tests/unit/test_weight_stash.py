"""PipeDream's weight stash in one process: versions, bound, and release."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from polytrain.pipeline.runtime import WeightStash, crossing_updates
from polytrain.pipeline.schedule import (
    ActionKind,
    max_in_flight,
    one_f_one_b,
    stash_bound,
    weight_version,
)


def _replay(p: int, s: int, m: int, u: int, live: bool = False) -> WeightStash:
    """Run stage ``s``'s 1F1B order through a stash, updating after every ``u`` backwards;
    ``live``: copies only for the micro-batches that cross an update."""
    weight = nn.Parameter(torch.zeros(3))
    stash = WeightStash({"w": weight}, bound=stash_bound(s, p, u))
    program = [a for a in one_f_one_b(p, m)[s] if a is not None]
    if live:
        stash.crossing = crossing_updates(program, u)
    for action in program:
        i = action.microbatch_index
        if action.kind is ActionKind.F:
            snapshot = stash.forward(i)
            used = weight if snapshot is None else snapshot["w"]
            assert float(used[0].detach()) == stash.version  # the live weights when F ran
        else:
            version, weights = stash.backward_weights(i)
            used = weight if weights is None else weights["w"]
            assert float(used[0].detach()) == version  # still that version
            stash.release(i, version)
            if (i + 1) % u == 0:
                with torch.no_grad():
                    weight += 1.0  # "update": w == number of updates so far
                stash.version += 1
    return stash


@pytest.mark.parametrize(("p", "m", "u"), [(2, 6, 1), (4, 9, 1), (5, 3, 1), (4, 12, 4), (5, 10, 2)])
def test_backward_uses_the_forward_version_within_the_bound(p: int, m: int, u: int) -> None:
    for s in range(p):
        stash = _replay(p, s, m, u)
        assert [v for _, v, _ in stash.log] == [weight_version(s, i, p, u) for i in range(m)]
        assert all(fv == bv for _, fv, bv in stash.log)
        assert stash.max_stashed <= stash_bound(s, p, u) <= max_in_flight(s, p)
        if m >= p + 2 * u:  # a long enough steady state: the bound is reached
            assert stash.max_stashed == stash_bound(s, p, u)
        assert not stash.snapshots  # all released


@pytest.mark.parametrize(("p", "m", "u"), [(2, 6, 1), (4, 9, 1), (4, 12, 4), (5, 10, 2)])
def test_live_forwards_keep_every_version_with_fewer_copies(p: int, m: int, u: int) -> None:
    """[Note: live forwards]: only micro-batches crossing an update are copied; the versions
    (and the live weight read at each backward, checked in `_replay`) do not change."""
    for s in range(p):
        copied, live = _replay(p, s, m, u), _replay(p, s, m, u, live=True)
        assert live.log == copied.log
        assert live.max_stashed <= copied.max_stashed
        assert not live.snapshots and not live.version_of
    assert _replay(p, p - 1, m, u, live=True).max_stashed == 0  # the last stage never copies


def test_crossing_updates_golden() -> None:
    stage0 = [a for a in one_f_one_b(2, 8)[0] if a is not None]  # F0 F1 B0 F2 B1 ... B7
    assert crossing_updates(stage0, 4) == {4}  # F4 runs before B3, whose update it misses
    assert crossing_updates(stage0, 1) == set(range(1, 8))
    assert crossing_updates([a for a in one_f_one_b(2, 8)[1] if a is not None], 1) == set()


def test_versions_and_bound_golden() -> None:
    for p in range(1, 6):
        for s in range(p):
            assert stash_bound(s, p) == max_in_flight(s, p)  # one update per micro-batch: p - s
    assert [weight_version(0, i, 3, 2) for i in range(8)] == [0, 0, 0, 0, 1, 1, 2, 2]
    assert [stash_bound(s, 4, 2) for s in range(4)] == [3, 2, 2, 1]


def test_stashing_beyond_the_bound_is_an_internal_error() -> None:
    stash = WeightStash({"w": nn.Parameter(torch.zeros(1))}, bound=1)
    stash.forward(0)
    stash.version += 1
    with pytest.raises(AssertionError, match="more than the bound 1"):
        stash.forward(1)

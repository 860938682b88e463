"""PipeDream's weight stash in one process: versions, bound, and release."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from polytrain.pipeline.runtime import WeightStash, stash_bound, stashed_version
from polytrain.pipeline.schedule import ActionKind, max_in_flight, one_f_one_b, weight_version


def _replay(p: int, s: int, m: int, u: int) -> WeightStash:
    """Run stage ``s``'s 1F1B order through a stash, updating after every ``u`` backwards."""
    weight = nn.Parameter(torch.zeros(3))
    stash = WeightStash({"w": weight}, bound=stash_bound(s, p, u))
    for action in one_f_one_b(p, m)[s]:
        assert action is not None
        i = action.microbatch_index
        if action.kind is ActionKind.F:
            snapshot = stash.forward(i)["w"]
            assert float(snapshot[0].detach()) == stash.version  # the live weights when F ran
        else:
            version, weights = stash.backward_weights(i)
            assert float(weights["w"][0].detach()) == version  # still that version
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
        assert [v for _, v, _ in stash.log] == [stashed_version(s, i, p, u) for i in range(m)]
        assert all(fv == bv for _, fv, bv in stash.log)
        assert stash.max_stashed <= stash_bound(s, p, u) <= max_in_flight(s, p)
        if m >= p + 2 * u:  # a long enough steady state: the bound is reached
            assert stash.max_stashed == stash_bound(s, p, u)
        assert not stash.snapshots  # all released


def test_versions_after_every_microbatch_are_the_schedule_packages() -> None:
    for p in range(1, 6):
        for s in range(p):
            assert stash_bound(s, p) == max_in_flight(s, p)
            for i in range(12):
                assert stashed_version(s, i, p) == weight_version(s, i, p)


def test_stashing_beyond_the_bound_is_an_internal_error() -> None:
    stash = WeightStash({"w": nn.Parameter(torch.zeros(1))}, bound=1)
    stash.forward(0)
    stash.version += 1
    with pytest.raises(AssertionError, match="more than the bound 1"):
        stash.forward(1)

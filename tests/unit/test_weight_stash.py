"""PipeDream's weight stash in one process: versions, bound, and release."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from polytrain.pipeline.runtime import WeightStash
from polytrain.pipeline.schedule import ActionKind, max_in_flight, one_f_one_b, weight_version


def _replay(p: int, s: int, m: int) -> WeightStash:
    """Run stage ``s``'s 1F1B order through a stash, updating the weights after each backward."""
    weight = nn.Parameter(torch.zeros(3))
    stash = WeightStash({"w": weight}, bound=max_in_flight(s, p))
    for action in one_f_one_b(p, m)[s]:
        assert action is not None
        i = action.microbatch_index
        if action.kind is ActionKind.F:
            snapshot = stash.forward(i)["w"]
            assert float(snapshot[0].detach()) == stash.version  # the live weights when F ran
        else:
            version, weights = stash.backward_weights(i)
            assert (
                float(weights["w"][0].detach()) == version
            )  # still that version, though w moved on
            stash.release(i, version)
            with torch.no_grad():
                weight += 1.0  # "update": w == number of updates so far
            stash.version += 1
    return stash


@pytest.mark.parametrize(("p", "m"), [(2, 6), (4, 9), (5, 3)])
def test_backward_uses_the_forward_version_within_the_bound(p: int, m: int) -> None:
    for s in range(p):
        stash = _replay(p, s, m)
        assert [v for _, v, _ in stash.log] == [weight_version(s, i, p) for i in range(m)]
        assert all(fv == bv for _, fv, bv in stash.log)
        assert stash.max_stashed <= max_in_flight(s, p)
        if m >= p:  # a full steady state: the bound is reached
            assert stash.max_stashed == max_in_flight(s, p)
        assert not stash.snapshots  # all released


def test_stashing_beyond_the_bound_is_an_internal_error() -> None:
    stash = WeightStash({"w": nn.Parameter(torch.zeros(1))}, bound=1)
    stash.forward(0)
    stash.version += 1
    with pytest.raises(AssertionError, match="more than the bound 1"):
        stash.forward(1)

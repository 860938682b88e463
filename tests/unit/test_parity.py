"""The parity helpers fail on missing, extra or empty states instead of passing vacuously."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from polytrain.testing import assert_state_close, max_abs_diff


def _state() -> dict[str, torch.Tensor]:
    return {"blocks.0.weight": torch.ones(2, 3), "blocks.0.bias": torch.zeros(3)}


def test_max_abs_diff_is_the_largest_element_difference() -> None:
    other = _state()
    other["blocks.0.bias"] = torch.tensor([0.0, -0.25, 0.1])
    assert max_abs_diff(other, _state()) == pytest.approx(0.25)
    assert max_abs_diff(_state(), _state()) == 0.0


@pytest.mark.parametrize("compare", [max_abs_diff, assert_state_close])
def test_missing_and_extra_keys_fail_with_their_names(compare: Callable[..., object]) -> None:
    fewer = _state()
    del fewer["blocks.0.bias"]
    with pytest.raises(AssertionError, match=r"missing \['blocks.0.bias'\], unexpected \[\]"):
        compare(fewer, _state())
    more = {**_state(), "blocks.1.weight": torch.ones(1)}
    with pytest.raises(AssertionError, match=r"missing \[\], unexpected \['blocks.1.weight'\]"):
        compare(more, _state())
    # the argument order does not hide a missing key: the expected side has keys of its own
    with pytest.raises(AssertionError, match=r"unexpected \['blocks.0.bias'\]"):
        compare(_state(), fewer)


@pytest.mark.parametrize("compare", [max_abs_diff, assert_state_close])
def test_empty_states_are_refused(compare: Callable[..., object]) -> None:
    with pytest.raises(AssertionError, match="both states are empty"):
        compare({}, {})
    with pytest.raises(AssertionError, match="missing"):
        compare({}, _state())


@pytest.mark.parametrize("compare", [max_abs_diff, assert_state_close])
def test_shapes_must_match_even_where_they_would_broadcast(compare: Callable[..., object]) -> None:
    wide = {**_state(), "blocks.0.bias": torch.zeros(1, 3)}
    with pytest.raises(AssertionError, match=r"blocks.0.bias: shape \(1, 3\) != \(3,\)"):
        compare(wide, _state())


def test_assert_state_close_names_the_parameter_that_differs() -> None:
    other = _state()
    other["blocks.0.weight"] = other["blocks.0.weight"] + 1e-3
    assert_state_close(other, _state(), atol=1e-2)
    with pytest.raises(
        AssertionError, match=r"blocks.0.weight differs: max abs difference 1.000e-03"
    ):
        assert_state_close(other, _state(), atol=1e-4)

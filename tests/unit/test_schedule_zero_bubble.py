"""Zero-bubble schedules ZB-H1 and ZBV (Qi et al. ICLR 2024): order, lowering with local
hand-offs, validation of split backwards, simulated bubbles and activation peaks (no torch)."""

from __future__ import annotations

import importlib
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from polytrain.errors import ScheduleError
from polytrain.pipeline.schedule import (
    ZERO_BUBBLE_DURATIONS,
    Action,
    ActionKind,
    Durations,
    Schedule,
    StageMap,
    build_next,
    interleaved_1f1b,
    lower,
    one_f_one_b,
    one_f_one_b_idle_time,
    peak_activations,
    render,
    simulate,
    simulated_bubble_ratio,
    validate,
    zb_h1,
    zb_h1_idle_time,
    zb_h1_peak_activations,
    zbv,
    zbv_idle_steps,
    zbv_peak_activations,
    zbv_stage_map,
)

Z = ZERO_BUBBLE_DURATIONS  # F = I = W = 1, B = 2
SIZES = [(p, m) for p in range(1, 9) for m in range(1, 3 * p + 2)]


def strings(schedule: Schedule) -> dict[int, list[str]]:
    return {rank: [str(a) for a in actions] for rank, actions in schedule.items()}


def idle_per_rank(schedule: Schedule, durations: Durations) -> list[int]:
    return [sum(cell is None for cell in row) for row in simulate(schedule, durations=durations)]


def durations(f: int, i: int, w: int) -> dict[ActionKind, int]:
    return {ActionKind.F: f, ActionKind.I: i, ActionKind.W: w, ActionKind.B: i + w}


# --- ZB-H1 --------------------------------------------------------------------------------------


def test_zb_h1_golden() -> None:
    # 1F1B's order with B -> I; rank r runs W(k) right after I(k + r).
    assert strings(zb_h1(2, 3)) == {
        0: ["0F0", "0F1", "0I0", "0W0", "0F2", "0I1", "0W1", "0I2", "0W2"],
        1: ["1F0", "1I0", "1F1", "1I1", "1W0", "1F2", "1I2", "1W1", "1W2"],
    }


def test_zb_h1_is_1f1b_with_split_backward() -> None:
    for p in range(1, 7):
        for m in range(1, 10):
            without_w = {
                r: [
                    Action(a.stage_index, ActionKind.B, a.microbatch_index)
                    if a.kind is ActionKind.I
                    else a
                    for a in row
                    if a is not None and a.kind is not ActionKind.W
                ]
                for r, row in zb_h1(p, m).items()
            }
            assert without_w == one_f_one_b(p, m)


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_zb_h1_validates_lowers_and_simulates(p: int, m: int) -> None:
    schedule, stage_map = build_next("zb-h1", p, m)
    assert schedule == zb_h1(p, m) and stage_map == StageMap(p)
    validate(schedule, p, m)
    lowered = lower(schedule)
    validate(lowered, p, m)
    assert simulate(lowered, durations=Z) == simulate(schedule, durations=Z)
    # As 1F1B: 4 comm actions per boundary and micro-batch (I carries the gradient, W nothing).
    assert sum(len(row) for row in lowered.values()) - 3 * p * m == 4 * (p - 1) * m


@pytest.mark.parametrize("times", [(1, 1, 1), (2, 2, 1), (1, 2, 1), (2, 1, 1), (3, 2, 2)])
@pytest.mark.parametrize(
    ("p", "m"), [(p, m) for p in range(2, 9) for m in (p, p + 1, 2 * p, 4 * p)]
)
def test_zb_h1_bubble_matches_the_paper(p: int, m: int, times: tuple[int, int, int]) -> None:
    # Measured: idle steps of every rank on the simulated grid. Qi et al. section 2.1: ZB-H1
    # idles (p-1)(T_F + T_B - T_W) (their B is our I) where 1F1B idles (p-1)(T_F + T_B + T_W),
    # for m >= p and T_W <= min(T_F, T_I) (every case here).
    f, i, w = times
    steps = durations(f, i, w)
    assert idle_per_rank(zb_h1(p, m), steps) == [zb_h1_idle_time(p, f, i, w)] * p
    assert idle_per_rank(one_f_one_b(p, m), steps) == [one_f_one_b_idle_time(p, f, i, w)] * p
    if times == (1, 1, 1):  # a third of 1F1B's bubble
        h1 = simulated_bubble_ratio(zb_h1(p, m), durations=steps)
        base = simulated_bubble_ratio(one_f_one_b(p, m), durations=steps)
        assert h1 == pytest.approx(base / 3) == pytest.approx((p - 1) / (3 * m))


def test_zb_h1_formula_needs_short_weight_gradients() -> None:
    # With T_W > T_F the deferred W cannot all hide; the formula's (p-1)(1+1-2) = 0 is not met
    # and the bubble stays at (p-1) T_F: documented, not claimed.
    assert idle_per_rank(zb_h1(4, 8), durations(1, 1, 2)) == [3] * 4
    assert zb_h1_idle_time(4, 1, 1, 2) == 0


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_zb_h1_activations_as_1f1b(p: int, m: int) -> None:
    # An activation counts until its W. Every rank holds min(p, m) at its peak: 1F1B's
    # first-stage peak, so the most any rank holds is 1F1B's.
    peaks = peak_activations(zb_h1(p, m))
    assert set(peaks.values()) == {zb_h1_peak_activations(p, m)}
    assert max(peaks.values()) == max(peak_activations(one_f_one_b(p, m)).values())


# --- ZBV ----------------------------------------------------------------------------------------


def test_zbv_golden_and_placement() -> None:
    assert zbv_stage_map(3) == StageMap(3, 2, "v")
    assert strings(zbv(1, 2)) == {
        0: ["0F0", "1F0", "1I0", "1W0", "0F1", "0I0", "0W0", "1F1", "1I1", "1W1", "0I1", "0W1"]
    }
    for p in range(1, 6):
        for rank, row in zbv(p, 2 * p).items():
            assert {a.stage_index for a in row if a is not None} == {rank, 2 * p - 1 - rank}


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_zbv_validates_lowers_and_simulates(p: int, m: int) -> None:
    schedule, stage_map = build_next("zbv", p, m)
    assert schedule == zbv(p, m) and stage_map == zbv_stage_map(p)
    validate(schedule, p, m, stage_map=stage_map)
    lowered = lower(schedule, stage_map=stage_map)
    validate(lowered, p, m, stage_map=stage_map)
    assert simulate(lowered, durations=Z) == simulate(schedule, durations=Z)
    # 2p stages, 2p - 1 boundaries, of which the tip of the V (p-1 -> p) is local.
    assert sum(len(row) for row in lowered.values()) - 3 * 2 * p * m == 4 * (2 * p - 2) * m
    tip = [
        a
        for a in lowered[p - 1]
        if a is not None and not a.is_compute and a.stage_index in (p - 1, p)
        if a.peer_stage in (p - 1, p)
    ]
    assert tip == []


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_zbv_p2p_order_is_consistent(p: int, m: int) -> None:
    stage_map = zbv_stage_map(p)
    lowered = lower(zbv(p, m), stage_map=stage_map)
    sent: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
    taken: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
    for rank, row in lowered.items():
        for a in row:
            assert a is not None
            s, i = a.stage_index, a.microbatch_index
            if a.kind is ActionKind.SEND_F:
                sent.setdefault(("act", rank, stage_map.rank_of(s + 1)), []).append((s, i))
            elif a.kind is ActionKind.RECV_F:
                taken.setdefault(("act", stage_map.rank_of(s - 1), rank), []).append((s - 1, i))
            elif a.kind is ActionKind.SEND_B:
                sent.setdefault(("grad", rank, stage_map.rank_of(s - 1)), []).append((s, i))
            elif a.kind is ActionKind.RECV_B:
                taken.setdefault(("grad", stage_map.rank_of(s + 1), rank), []).append((s + 1, i))
    assert sent == taken


@pytest.mark.parametrize(("p", "m"), [(p, m) for p in range(1, 9) for m in range(1, 4 * p + 1)])
def test_zbv_bubble_and_memory(p: int, m: int) -> None:
    # Measured with F = I = W = 1 step per chunk. From m >= 2p - 1 every rank idles p - 1 steps
    # whatever m, none of them between its first and last action: a bubble ratio of (p-1)/(6m), half of ZB-H1's (p-1)/(3m) on the same model
    # (a chunk is half a stage), at most 1/12 for m >= 2p. Peak: 2p chunks = p stages, as 1F1B.
    schedule = zbv(p, m)
    peaks = peak_activations(schedule)
    assert max(peaks.values()) <= zbv_peak_activations(p)
    if m >= 2 * p - 1:
        assert idle_per_rank(schedule, Z) == [zbv_idle_steps(p)] * p
        # All of it is the staircase: rank r starts r steps late and ends p - 1 - r early.
        for rank, row in enumerate(simulate(schedule, durations=Z)):
            busy = [t for t, cell in enumerate(row) if cell is not None]
            assert (busy[0], len(row) - 1 - busy[-1]) == (rank, p - 1 - rank)
            assert len(busy) == busy[-1] - busy[0] + 1
        ratio = simulated_bubble_ratio(schedule, durations=Z)
        assert ratio == pytest.approx((p - 1) / (6 * m))
        assert set(peaks.values()) == {zbv_peak_activations(p)}
        assert zbv_peak_activations(p) / 2 == max(peak_activations(one_f_one_b(p, m)).values())
    if m >= 2 * p and p > 1:
        assert ratio <= 1 / 12
        h1 = simulated_bubble_ratio(zb_h1(p, m), durations=Z)
        base = simulated_bubble_ratio(one_f_one_b(p, m), durations=Z)
        assert ratio < h1 < base


# --- validation of split backwards --------------------------------------------------------------


def test_validate_catches_split_backward_errors() -> None:
    w_first = zb_h1(2, 2)
    row = w_first[1]
    i, w = row.index(Action.parse("1I0")), row.index(Action.parse("1W0"))
    row[i], row[w] = row[w], row[i]
    with pytest.raises(ScheduleError, match="rank 1 runs 1W0 before 1I0: expected the weight"):
        validate(w_first, 2, 2)

    no_w = zb_h1(2, 2)
    no_w[0].remove(Action.parse("0W1"))
    with pytest.raises(ScheduleError, match="rank 0 never runs 0W1: expected exactly one F and"):
        validate(no_w, 2, 2)

    both = zb_h1(2, 2)
    both[0].append(Action.parse("0B1"))
    with pytest.raises(ScheduleError, match="also splits that backward into I and W"):
        validate(both, 2, 2)


def test_simulation_respects_split_dependencies() -> None:
    p, m = 4, 8
    stage_map = zbv_stage_map(p)
    for schedule, num_stages in ((zb_h1(p, m), p), (zbv(p, m), stage_map.num_stages)):
        grid = simulate(schedule, durations=Z)
        start = {a: t for row in grid for t, a in reversed(list(enumerate(row))) if a}
        for s in range(num_stages):
            for k in range(m):
                f, i, w = (
                    Action(s, kind, k) for kind in (ActionKind.F, ActionKind.I, ActionKind.W)
                )
                assert start[f] < start[i] < start[w]
                if s > 0:
                    assert start[Action(s - 1, ActionKind.F, k)] < start[f]
                if s < num_stages - 1:
                    assert start[Action(s + 1, ActionKind.I, k)] < start[i]


def test_docstring_pictures_are_real() -> None:
    doc = str(importlib.import_module("polytrain.pipeline.schedule.zero_bubble").__doc__)
    assert textwrap.indent(render(zb_h1(4, 6), durations=Z), "    ") in doc
    assert textwrap.indent(render(zbv(2, 4), durations=Z), "    ") in doc


def test_pipeline_doc_pictures_are_real() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "pipeline.md").read_text()
    assert render(interleaved_1f1b(2, 4, 2)) in doc
    assert render(zb_h1(4, 6), durations=Z) in doc
    assert render(zbv(2, 4), durations=Z) in doc


@pytest.mark.parametrize("generator", [zb_h1, zbv])
@pytest.mark.parametrize(
    ("p", "m", "needle"),
    [(0, 4, "num_ranks = 0"), (2, 0, "num_microbatches = 0"), (2, 1.5, "num_microbatches = 1.5")],
)
def test_zero_bubble_bad_sizes_one_line(
    generator: Callable[[int, int], Schedule], p: int, m: int, needle: str
) -> None:
    with pytest.raises(ScheduleError) as info:
        generator(p, m)
    assert needle in str(info.value) and "\n" not in str(info.value)

"""Virtual stages (StageMap), I/W actions and interleaved 1F1B (Narayanan et al. SC'21): IR,
generator, lowering over shared channels, validation, simulation and formulas (no torch)."""

from __future__ import annotations

import importlib
import textwrap

import pytest

from polytrain.errors import ScheduleError
from polytrain.pipeline.schedule import (
    NEXT_SCHEDULE_NAMES,
    SCHEDULE_NAMES,
    ZERO_BUBBLE_DURATIONS,
    Action,
    ActionKind,
    P2PMessage,
    Schedule,
    StageMap,
    build,
    build_next,
    build_staged,
    interleaved_1f1b,
    interleaved_bubble_ratio,
    interleaved_peak_activations,
    interleaved_stage_map,
    lower,
    one_f_one_b,
    p2p_message,
    peak_activation_memory,
    peak_activations,
    render,
    simulate,
    simulated_bubble_fraction,
    simulated_bubble_ratio,
    stages_per_rank,
    validate,
)

B_EQUALS_F = {ActionKind.F: 1, ActionKind.B: 1}
B_TWICE_F = {ActionKind.F: 1, ActionKind.B: 2}
SIZES = [(p, m, v) for p in range(1, 9) for v in range(1, 5) for m in (p, 2 * p, 3 * p)]


def strings(schedule: Schedule) -> dict[int, list[str]]:
    return {rank: [str(a) for a in actions] for rank, actions in schedule.items()}


def channels(lowered: Schedule, stage_map: StageMap) -> dict[tuple[str, int, int], list[list]]:
    """(kind, sender rank, receiver rank) -> [sent messages, received messages] in program
    order, each message named (sending stage, micro-batch): an oracle independent of validate."""
    table: dict[tuple[str, int, int], list[list]] = {}
    for rank, row in lowered.items():
        for a in row:
            assert a is not None
            s, i = a.stage_index, a.microbatch_index
            if a.kind is ActionKind.SEND_F:
                key, end, message = ("act", rank, stage_map.rank_of(s + 1)), 0, (s, i)
            elif a.kind is ActionKind.RECV_F:
                key, end, message = ("act", stage_map.rank_of(s - 1), rank), 1, (s - 1, i)
            elif a.kind is ActionKind.SEND_B:
                key, end, message = ("grad", rank, stage_map.rank_of(s - 1)), 0, (s, i)
            elif a.kind is ActionKind.RECV_B:
                key, end, message = ("grad", stage_map.rank_of(s + 1), rank), 1, (s + 1, i)
            else:
                continue
            table.setdefault(key, [[], []])[end].append(message)
    return table


# --- StageMap -----------------------------------------------------------------------------------


def test_stage_map_placements() -> None:
    loop, v = StageMap(3, 2, "loop"), StageMap(3, 2, "v")
    assert [loop.rank_of(s) for s in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [v.rank_of(s) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    assert loop.stages_of(1) == (1, 4) and v.stages_of(1) == (1, 4)
    assert v.stages_of(0) == (0, 5) and v.stages_of(2) == (2, 3)
    assert [loop.chunk_of(s) for s in range(6)] == [0, 0, 0, 1, 1, 1]
    assert v.is_local(2, 3) and not loop.is_local(2, 3)
    assert StageMap(4).num_stages == 4 and StageMap(4).stages_of(3) == (3,)
    assert StageMap(1, 3).stages_of(0) == (0, 1, 2)
    # Every stage on exactly one rank, v stages per rank, for both styles.
    for p in range(1, 6):
        for k in range(1, 5):
            for style in ("loop", "v"):
                m = StageMap(p, k, style)
                held = sorted(s for r in range(p) for s in m.stages_of(r))
                assert held == list(range(p * k))
                assert all(len(m.stages_of(r)) == k for r in range(p))


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((0,), "StageMap.num_ranks = 0"),
        ((2, 0), "StageMap.stages_per_rank = 0"),
        ((2, 2, "ring"), "StageMap.style = 'ring'"),
        ((True,), "StageMap.num_ranks = True"),
    ],
)
def test_stage_map_rejects_bad_fields(args: tuple, needle: str) -> None:
    with pytest.raises(ScheduleError, match=needle):
        StageMap(*args)


def test_stage_map_rejects_bad_stage_and_rank() -> None:
    with pytest.raises(ScheduleError, match=r"stage_index = 6: expected an integer in 0\.\.5"):
        StageMap(3, 2).rank_of(6)
    with pytest.raises(ScheduleError, match=r"rank = 3: expected an integer in 0\.\.2"):
        StageMap(3, 2).stages_of(3)


def test_stage_map_infer() -> None:
    assert StageMap.infer(one_f_one_b(4, 4)) == StageMap(4)
    assert StageMap.infer(interleaved_1f1b(4, 4, 3)) == StageMap(4, 3, "loop")
    assert StageMap.infer(build_next("zbv", 4, 8)[0]) == StageMap(4, 2, "v")
    odd = {0: [Action.parse("0F0"), Action.parse("2F0")], 1: [Action.parse("1F0")], 2: []}
    with pytest.raises(ScheduleError, match="no stage map explains"):
        StageMap.infer(odd)


# --- I and W actions ----------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["2I0", "2W0", "11I3", "0W10"])
def test_split_backward_actions_round_trip(text: str) -> None:
    action = Action.parse(text)
    assert str(action) == repr(action) == text
    assert action.is_compute and action.peer_stage is None


def test_lower_split_backward() -> None:
    # I carries the gradient traffic of the backward; W exchanges nothing.
    schedule = {
        0: [Action.parse(t) for t in ["0F0", "0I0", "0W0"]],
        1: [Action.parse(t) for t in ["1F0", "1I0", "1W0"]],
    }
    assert strings(lower(schedule)) == {
        0: ["0F0", "0SEND_F0", "0RECV_B0", "0I0", "0W0"],
        1: ["1RECV_F0", "1F0", "1I0", "1SEND_B0", "1W0"],
    }
    validate(lower(schedule), 2, 1)


# --- interleaved 1F1B: order ----------------------------------------------------------------------


def test_interleaved_golden() -> None:
    # p = 2, v = 2: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3. Warm-up 2(p-1-r) + (v-1)p:
    # 4 forwards on rank 0, 2 on rank 1; forwards walk chunk 0 then chunk 1 per group of p.
    assert strings(interleaved_1f1b(2, 2, 2)) == {
        0: ["0F0", "0F1", "2F0", "2F1", "2B0", "2B1", "0B0", "0B1"],
        1: ["1F0", "1F1", "3F0", "3B0", "3F1", "3B1", "1B0", "1B1"],
    }


def test_interleaved_one_chunk_is_1f1b() -> None:
    for p in range(1, 6):
        for m in range(1, 9):
            assert interleaved_1f1b(p, m, 1) == one_f_one_b(p, m)


def test_docstring_picture_is_real() -> None:
    doc = importlib.import_module("polytrain.pipeline.schedule.interleaved").__doc__
    assert textwrap.indent(render(interleaved_1f1b(2, 4, 2)), "    ") in str(doc)


# --- interleaved 1F1B: every size ---------------------------------------------------------------


@pytest.mark.parametrize(("p", "m", "v"), SIZES)
def test_interleaved_validates_lowers_and_simulates(p: int, m: int, v: int) -> None:
    schedule, stage_map = build_next("interleaved-1f1b", p, m, virtual_stages=v)
    assert schedule == interleaved_1f1b(p, m, v) and stage_map == interleaved_stage_map(p, v)
    validate(schedule, p, m, stage_map=stage_map)
    lowered = lower(schedule, stage_map=stage_map)
    validate(lowered, p, m, stage_map=stage_map)
    for durations in (B_EQUALS_F, B_TWICE_F):
        assert simulate(lowered, durations=durations) == simulate(schedule, durations=durations)
    # Every stage boundary crosses ranks when p > 1 (loop placement): 4 comm actions per
    # boundary and micro-batch; with p == 1 every hand-off is local.
    num_comm = sum(len(row) for row in lowered.values()) - 2 * p * v * m
    assert num_comm == (4 * (p * v - 1) * m if p > 1 else 0)


@pytest.mark.parametrize(("p", "m", "v"), SIZES)
def test_interleaved_p2p_order_is_consistent(p: int, m: int, v: int) -> None:
    stage_map = interleaved_stage_map(p, v)
    table = channels(lower(interleaved_1f1b(p, m, v), stage_map=stage_map), stage_map)
    for key, (sent, received) in table.items():
        assert sent == received, key
    if p > 1 and v > 1:
        # Rank p-1 -> rank 0 carries the activations of stages p-1, 2p-1, ...: one channel,
        # several stages, still one order.
        senders = {stage for stage, _ in table[("act", p - 1, 0)][0]}
        assert senders == {c * p + p - 1 for c in range(v - 1)}


@pytest.mark.parametrize(("p", "m", "v"), SIZES)
def test_interleaved_bubble_matches_formula(p: int, m: int, v: int) -> None:
    # Measured: idle cells / busy cells of the simulated rank x step grid (= bubble time over
    # ideal time), with a chunk's B one step (B = F) and two steps (B = 2F).
    schedule = interleaved_1f1b(p, m, v)
    expected = interleaved_bubble_ratio(p, m, v)
    for durations in (B_EQUALS_F, B_TWICE_F):
        ratio = simulated_bubble_ratio(schedule, durations=durations)
        assert ratio == pytest.approx(expected)
        fraction = simulated_bubble_fraction(schedule, durations=durations)
        assert fraction == pytest.approx(ratio / (1 + ratio))
    # F = B: every rank busy 2vm steps, the makespan 2vm + 2(p - 1).
    grid = simulate(schedule)
    assert all(len(row) == 2 * v * m + 2 * (p - 1) for row in grid)


@pytest.mark.parametrize(("p", "m", "v"), SIZES)
def test_interleaved_activation_peaks(p: int, m: int, v: int) -> None:
    peaks = peak_activations(interleaved_1f1b(p, m, v))
    assert peaks == {r: interleaved_peak_activations(r, p, m, v) for r in range(p)}
    if v > 1 and p > 1 and m >= 2 * p:
        # Rank 0 holds p (1 + (p - 1) / (p v)) stages' worth (v chunks make one stage): more
        # than 1F1B's p, by the factor of Korthikanti et al. 2022.
        assert peaks[0] / v == pytest.approx(p * (1 + (p - 1) / (p * v)))
        assert peaks[0] / v > max(peak_activations(one_f_one_b(p, m)).values()) == p


def test_peak_activation_memory_weights_stages() -> None:
    schedule = interleaved_1f1b(2, 4, 2)
    sizes = {0: 1.0, 1: 1.0, 2: 10.0, 3: 10.0}
    memory = peak_activation_memory(schedule, sizes.__getitem__)
    # Rank 0 peaks before 2B0 (0F0 0F1 2F0 2F1 0F2: 3 small, 2 large chunks); rank 1 before
    # 3B0 (1F0 1F1 3F0). Counting chunks alone, both would peak elsewhere or tie.
    assert memory == {0: 3 * 1.0 + 2 * 10.0, 1: 2 * 1.0 + 10.0}
    assert peak_activation_memory(schedule, lambda s: 1.0) == peak_activations(schedule)


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        ((4, 6, 2), ("num_microbatches = 6", "multiple of num_ranks = 4", "to 4 or 8")),
        ((4, 3, 2), ("num_microbatches = 3", "to 4")),
        ((4, 8, 0), ("virtual_stages = 0", "expected an integer >= 1")),
        ((0, 8, 2), ("num_ranks = 0",)),
        ((2, True, 2), ("num_microbatches = True",)),
    ],
)
def test_interleaved_bad_sizes_one_line(args: tuple, needles: tuple[str, ...]) -> None:
    with pytest.raises(ScheduleError) as info:
        interleaved_1f1b(*args)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message


def test_staged_schedules_are_config_values() -> None:
    """The runtime runs them ([Note: schedules with a stage map]): they are values of
    ``pipeline.schedule``, built with their map by `build_next` / `build_staged`, not `build`."""
    assert NEXT_SCHEDULE_NAMES == ("interleaved-1f1b", "zb-h1", "zbv")
    assert SCHEDULE_NAMES == ("gpipe", "1f1b", "pipedream", *NEXT_SCHEDULE_NAMES)
    for name in NEXT_SCHEDULE_NAMES:
        with pytest.raises(ScheduleError, match="build it with build_next"):
            build(name, 4, 8)
    with pytest.raises(ScheduleError, match="needs virtual_stages"):
        build_next("interleaved-1f1b", 4, 8)
    with pytest.raises(ScheduleError, match="zbv has 2 stage"):
        build_next("zbv", 4, 8, virtual_stages=3)
    with pytest.raises(ScheduleError, match=r"'1f1b' is built by build\(\)"):
        build_next("1f1b", 4, 8)
    assert build_staged("1f1b", 4, 8) == (build("1f1b", 4, 8), StageMap(4))
    assert build_staged("zbv", 4, 8) == build_next("zbv", 4, 8)
    assert build_staged("zb-h1", 4, 8, virtual_stages=3) == build_next("zb-h1", 4, 8)
    assert build_staged("interleaved-1f1b", 2, 4, virtual_stages=2) == build_next(
        "interleaved-1f1b", 2, 4, virtual_stages=2
    )
    per_rank = {name: stages_per_rank(name, 3) for name in SCHEDULE_NAMES}
    assert per_rank == {
        "gpipe": 1,
        "1f1b": 1,
        "pipedream": 1,
        "interleaved-1f1b": 3,
        "zb-h1": 1,
        "zbv": 2,
    }


def test_validate_catches_cross_stage_reorder_on_a_shared_channel() -> None:
    # p = 2, v = 3: rank 0 sends stage 2's and stage 4's activations to rank 1 on one channel.
    # Swap a 2F and a 4F on rank 0: each stage's own order is intact, but rank 0 now sends the
    # two messages in the other order than rank 1 takes them (matching is per channel).
    stage_map = interleaved_stage_map(2, 3)
    schedule = interleaved_1f1b(2, 4, 3)
    row = schedule[0]
    at = next(
        k
        for k in range(len(row) - 1)
        if str(row[k]).startswith("2F") and str(row[k + 1]).startswith("4F")
    )
    row[at], row[at + 1] = row[at + 1], row[at]
    for candidate in (schedule, lower(schedule, stage_map=stage_map)):
        with pytest.raises(ScheduleError) as info:
            validate(candidate, 2, 4, stage_map=stage_map)
        assert "match in order" in str(info.value)
        assert "of stage 2" in str(info.value) and "of stage 4" in str(info.value)


def test_validate_catches_stage_on_the_wrong_rank() -> None:
    stage_map = interleaved_stage_map(2, 2)
    schedule = interleaved_1f1b(2, 2, 2)
    schedule[1].append(schedule[0].pop())  # 0B1 moves to rank 1
    with pytest.raises(ScheduleError) as info:
        validate(schedule, 2, 2, stage_map=stage_map)
    assert "rank 1 runs 0B1, but stage 0 lives on rank 0" in str(info.value)
    with pytest.raises(ScheduleError, match=r"expected stage indices 0\.\.3"):
        validate({0: [Action.parse("4F0")], 1: []}, 2, 1, stage_map=stage_map)
    with pytest.raises(ScheduleError, match="stage_map has 2 ranks where num_ranks = 3"):
        validate(schedule, 3, 2, stage_map=stage_map)


def test_local_hand_off_has_no_p2p() -> None:
    # p = 1: all stages on one rank, nothing to send.
    schedule = interleaved_1f1b(1, 3, 3)
    assert lower(schedule) == schedule
    validate(schedule, 1, 3, stage_map=StageMap(1, 3))
    # A receive between two stages of one rank is refused.
    bad = lower(schedule)
    bad[0].insert(0, Action.parse("1RECV_F0"))
    with pytest.raises(ScheduleError, match="stage 0 is on the same rank"):
        validate(bad, 1, 3, stage_map=StageMap(1, 3))


def test_durations_fill_cells_and_are_checked() -> None:
    grid = simulate(one_f_one_b(2, 1), durations=B_TWICE_F)
    assert [[str(c) if c else "." for c in row] for row in grid] == [
        ["0F0", ".", ".", ".", "0B0", "0B0"],
        [".", "1F0", "1B0", "1B0", ".", "."],
    ]
    assert simulate(one_f_one_b(3, 4), durations={}) == simulate(one_f_one_b(3, 4))
    with pytest.raises(ScheduleError, match=r"durations\[B\] = 0"):
        simulate(one_f_one_b(2, 1), durations={ActionKind.B: 0})
    # The zero-bubble durations leave F and I at one step and make a full B two.
    assert ZERO_BUBBLE_DURATIONS[ActionKind.B] == 2 * ZERO_BUBBLE_DURATIONS[ActionKind.I]


def test_p2p_message_names_channel_and_content() -> None:
    # ZBV on 3 ranks: rank 1 holds stages 1 and 4; stage 4's activations go to stage 5 on rank 0.
    v = StageMap(3, 2, "v")
    send = p2p_message(Action.parse("4SEND_F2"), v)
    recv = p2p_message(Action.parse("5RECV_F2"), v)
    assert send == recv == P2PMessage("activations", 1, 0, 4, 2)
    assert send is not None and send.channel == ("activations", 1, 0)
    grad = p2p_message(Action.parse("1RECV_B0"), v)
    assert grad == p2p_message(Action.parse("2SEND_B0"), v) == P2PMessage("gradients", 2, 1, 2, 0)
    assert p2p_message(Action.parse("1I0"), v) is None

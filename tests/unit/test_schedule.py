"""Pipeline schedule IR: generators, lowering, validation, simulation and rendering (no torch)."""

from __future__ import annotations

import ast
import importlib
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

import polytrain.pipeline.schedule as schedule_pkg
from polytrain.errors import ScheduleError
from polytrain.pipeline.schedule import (
    SCHEDULE_NAMES,
    Action,
    ActionKind,
    Schedule,
    bubble_fraction,
    build,
    gpipe,
    lower,
    max_in_flight,
    one_f_one_b,
    peak_activations,
    pipedream,
    render,
    simulate,
    simulated_bubble_fraction,
    validate,
    weight_version,
)

Generator = Callable[[int, int], Schedule]
GENERATORS: dict[str, Generator] = {"gpipe": gpipe, "1f1b": one_f_one_b, "pipedream": pipedream}
SIZES = [(p, m) for p in range(1, 7) for m in range(1, 11)]


def strings(schedule: Schedule) -> dict[int, list[str]]:
    return {rank: [str(a) for a in actions] for rank, actions in schedule.items()}


def parse(rows: dict[int, list[str]]) -> Schedule:
    return {rank: [Action.parse(text) for text in row] for rank, row in rows.items()}


# --- action IR --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text", ["2F0", "1B3", "2SEND_F0", "3RECV_F0", "2SEND_B1", "1RECV_B1", "12RECV_B34", "0F10"]
)
def test_action_round_trip(text: str) -> None:
    action = Action.parse(text)
    assert str(action) == text
    assert repr(action) == text
    assert Action.parse(str(action)) == action


def test_action_fields_and_peers() -> None:
    assert Action.parse("2F0") == Action(2, ActionKind.F, 0)
    assert Action.parse("1RECV_B1") == Action(1, ActionKind.RECV_B, 1)
    assert Action.parse("2SEND_F0").peer_stage == 3
    assert Action.parse("3RECV_F0").peer_stage == 2
    assert Action.parse("2SEND_B1").peer_stage == 1
    assert Action.parse("1RECV_B1").peer_stage == 2
    assert Action.parse("2F0").peer_stage is None
    assert Action.parse("2B0").is_compute and not Action.parse("2SEND_B0").is_compute


@pytest.mark.parametrize(
    "text", ["", "F0", "2F", "2X0", "2f0", " 2F0", "2F0 ", "02F0", "2F01", "2SEND0", "-1F0", "2F-1"]
)
def test_action_parse_rejects_bad_strings(text: str) -> None:
    with pytest.raises(ScheduleError) as info:
        Action.parse(text)
    message = str(info.value)
    assert repr(text) in message
    assert "'<stage_index><kind><microbatch_index>'" in message
    assert "SEND_F" in message


def test_action_rejects_bad_fields() -> None:
    with pytest.raises(ScheduleError, match="stage_index"):
        Action(-1, ActionKind.F, 0)
    with pytest.raises(ScheduleError, match="microbatch_index"):
        Action(0, ActionKind.B, True)
    with pytest.raises(ScheduleError, match="kind"):
        Action(0, "F", 0)  # type: ignore[arg-type]


# --- golden orders ----------------------------------------------------------------------------


def test_gpipe_golden() -> None:
    assert strings(gpipe(2, 2)) == {
        0: ["0F0", "0F1", "0B1", "0B0"],
        1: ["1F0", "1F1", "1B1", "1B0"],
    }
    assert strings(gpipe(1, 3)) == {0: ["0F0", "0F1", "0F2", "0B2", "0B1", "0B0"]}


def test_one_f_one_b_golden() -> None:
    assert strings(one_f_one_b(2, 3)) == {
        0: ["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"],
        1: ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"],
    }
    assert strings(one_f_one_b(4, 2)) == {
        0: ["0F0", "0F1", "0B0", "0B1"],
        1: ["1F0", "1F1", "1B0", "1B1"],
        2: ["2F0", "2F1", "2B0", "2B1"],
        3: ["3F0", "3B0", "3F1", "3B1"],
    }


def test_pipedream_has_the_1f1b_order() -> None:
    for p, m in SIZES:
        assert pipedream(p, m) == one_f_one_b(p, m)


def test_lower_golden() -> None:
    assert strings(lower(one_f_one_b(2, 2))) == {
        0: ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
        1: ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"],
    }
    lowering = importlib.import_module("polytrain.pipeline.schedule.lowering")
    for rank, row in strings(lower(one_f_one_b(2, 2))).items():
        assert f"rank {rank}: {' '.join(row)}" in str(lowering.__doc__)


def test_render_golden() -> None:
    assert render(gpipe(2, 2)) == (
        "   step    0   1   2   3   4   5\n"
        "   rank 0  0F0 0F1 .   .   0B1 0B0\n"
        "   rank 1  .   1F0 1F1 1B1 1B0 ."
    )
    assert "0SEND_F0" in render(lower(gpipe(2, 2)), program_order=True)
    assert render(lower(gpipe(2, 2))) == render(gpipe(2, 2))


@pytest.mark.parametrize(
    ("module", "schedule"),
    [("gpipe", gpipe(4, 4)), ("one_f_one_b", one_f_one_b(4, 6)), ("pipedream", pipedream(3, 6))],
)
def test_docstring_pictures_are_real(module: str, schedule: Schedule) -> None:
    doc = importlib.import_module(f"polytrain.pipeline.schedule.{module}").__doc__
    assert textwrap.indent(render(schedule), "    ") in str(doc)


# --- every generator, every small size --------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GENERATORS))
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_generators_validate_before_and_after_lowering(name: str, p: int, m: int) -> None:
    schedule = build(name, p, m)
    assert schedule == GENERATORS[name](p, m)
    validate(schedule, p, m)
    lowered = lower(schedule)
    validate(lowered, p, m)
    assert simulate(lowered) == simulate(schedule)
    # 2(p-1) comm actions per micro-batch on inner stages, half that on the ends, none if p == 1.
    num_comm = sum(len(row) for row in lowered.values()) - 2 * p * m
    assert num_comm == 4 * (p - 1) * m


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_activations_in_flight(p: int, m: int) -> None:
    assert peak_activations(gpipe(p, m)) == dict.fromkeys(range(p), m)
    peaks = peak_activations(one_f_one_b(p, m))
    for stage in range(p):
        assert peaks[stage] == min(p - stage, m) <= p - stage


@pytest.mark.parametrize("generator", [gpipe, one_f_one_b])
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_simulated_bubble_matches_formula(generator: Generator, p: int, m: int) -> None:
    # Time model: F and B one step each, communication free. Each rank is busy 2m steps out of
    # 2(m + p - 1), so the idle fraction is (p - 1) / (m + p - 1) for GPipe and 1F1B alike.
    grid = simulate(generator(p, m))
    assert all(len(row) == 2 * (m + p - 1) for row in grid)
    assert all(sum(cell is not None for cell in row) == 2 * m for row in grid)
    assert simulated_bubble_fraction(generator(p, m)) == pytest.approx(bubble_fraction(p, m))


def test_simulation_respects_dependencies() -> None:
    p, m = 4, 6
    for schedule in (gpipe(p, m), one_f_one_b(p, m)):
        when = {a: t for row in simulate(schedule) for t, a in enumerate(row) if a is not None}
        for s in range(p):
            for i in range(m):
                f, b = Action(s, ActionKind.F, i), Action(s, ActionKind.B, i)
                assert when[f] < when[b]
                if s > 0:
                    assert when[Action(s - 1, ActionKind.F, i)] < when[f]
                if s < p - 1:
                    assert when[Action(s + 1, ActionKind.B, i)] < when[b]


# --- PipeDream weight stashing ----------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_pipedream_weight_versions(p: int, m: int) -> None:
    """One update per backward: version of F(i) = backwards before it; stash bounded by p - s."""
    for stage, row in pipedream(p, m).items():
        updates = 0
        stash: dict[int, int] = {}  # micro-batch in flight -> weight version its forward used
        for action in row:
            assert action is not None
            i = action.microbatch_index
            if action.kind is ActionKind.F:
                assert weight_version(stage, i, p) == updates
                stash[i] = updates
                assert len(stash) <= max_in_flight(stage, p) == p - stage
                assert len(set(stash.values())) <= max_in_flight(stage, p)
            else:
                staleness = updates - stash.pop(i)
                assert updates == i
                assert staleness == min(i, p - 1 - stage)
                updates += 1


def test_pipedream_helpers_reject_bad_stage() -> None:
    with pytest.raises(ScheduleError, match=r"stage_index = 4: expected an integer in 0\.\.3"):
        max_in_flight(4, 4)
    with pytest.raises(ScheduleError, match="num_stages"):
        max_in_flight(0, 0)
    with pytest.raises(ScheduleError, match="microbatch_index"):
        weight_version(0, -1, 2)


# --- build --------------------------------------------------------------------------------------


def test_build_names() -> None:
    assert SCHEDULE_NAMES == ("gpipe", "1f1b", "pipedream", "interleaved-1f1b", "zb-h1", "zbv")
    with pytest.raises(ScheduleError) as info:
        build("interleaved", 2, 2)
    message = str(info.value)
    assert "'interleaved'" in message
    assert all(name in message for name in SCHEDULE_NAMES)


@pytest.mark.parametrize(("p", "m"), [(0, 1), (1, 0), (-1, 4), (True, 2), (2, 1.5)])
@pytest.mark.parametrize("name", list(GENERATORS))
def test_build_rejects_bad_sizes(name: str, p: int, m: int) -> None:
    with pytest.raises(ScheduleError, match="expected an integer >= 1"):
        build(name, p, m)
    with pytest.raises(ScheduleError, match="expected an integer >= 1"):
        GENERATORS[name](p, m)


# --- validator catches corrupted schedules ------------------------------------------------------


def assert_grid_message(error: pytest.ExceptionInfo[ScheduleError], *needles: str) -> list[str]:
    lines = str(error.value).splitlines()
    assert len(lines) >= 3, "one-line summary, then a header and one row per rank"
    assert lines[0].startswith("invalid pipeline schedule:") or "deadlocks" in lines[0]
    assert lines[1].lstrip().startswith(("slot", "step"))
    assert any(line.startswith(">> rank") for line in lines[2:])
    for needle in needles:
        assert needle in str(error.value)
    return lines


def test_validate_catches_swapped_forward_and_backward() -> None:
    schedule = one_f_one_b(3, 4)
    row = schedule[1]
    f, b = row.index(Action.parse("1F0")), row.index(Action.parse("1B0"))
    row[f], row[b] = row[b], row[f]
    with pytest.raises(ScheduleError) as info:
        validate(schedule, 3, 4)
    lines = assert_grid_message(info, "rank 1 runs 1B0 before 1F0", "!1B0", "!1F0")
    assert lines[3].startswith(">> rank 1")


def test_validate_catches_swapped_forwards() -> None:
    schedule = gpipe(3, 3)
    schedule[1][0], schedule[1][1] = schedule[1][1], schedule[1][0]
    with pytest.raises(ScheduleError) as info:
        validate(schedule, 3, 3)
    assert_grid_message(info, "match in order", "!1F1", "!0F0")


def test_validate_catches_dropped_action() -> None:
    schedule = one_f_one_b(2, 3)
    schedule[1].remove(Action.parse("1B2"))
    with pytest.raises(ScheduleError) as info:
        validate(schedule, 2, 3)
    lines = assert_grid_message(info, "rank 1 never runs 1B2")
    assert lines[3].startswith(">> rank 1") and lines[2].startswith("   rank 0")


def test_validate_catches_deadlock() -> None:
    # Counts, per-rank order and message order are fine, but 0B0 waits for 1B0, which waits
    # (through 1F1) for 0F1, which rank 0 runs after 0B0.
    schedule = parse({0: ["0F0", "0B0", "0F1", "0B1"], 1: ["1F0", "1F1", "1B0", "1B1"]})
    with pytest.raises(ScheduleError) as info:
        validate(schedule, 2, 2)
    lines = assert_grid_message(info, "deadlocks at step 2", "!0B0", "!1F1", "waits at 0B0 for 1B0")
    assert lines[1].lstrip().startswith("step")
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(schedule)


def test_validate_catches_lowered_corruption() -> None:
    dropped = lower(one_f_one_b(3, 3))
    dropped[2].remove(Action.parse("2RECV_F1"))
    with pytest.raises(ScheduleError) as info:
        validate(dropped, 3, 3)
    assert_grid_message(info, "never runs 2RECV_F1")

    late = lower(one_f_one_b(3, 3))
    late[1].remove(Action.parse("1SEND_F0"))
    late[1].insert(0, Action.parse("1SEND_F0"))
    with pytest.raises(ScheduleError) as info:
        validate(late, 3, 3)
    assert_grid_message(info, "runs 1SEND_F0 before 1F0")

    # Rank 0 takes its backwards in another order than rank 1 sends the gradients.
    reordered = gpipe(2, 3)
    reordered[0][3], reordered[0][4] = reordered[0][4], reordered[0][3]
    for candidate in (reordered, lower(reordered)):
        with pytest.raises(ScheduleError) as info:
            validate(candidate, 2, 3)
        assert_grid_message(info, "takes gradients of micro-batch 1", "match in order")


@pytest.mark.parametrize(
    ("rows", "needle"),
    [
        ({0: ["0F0", "0B0"], 2: ["2F0", "2B0"]}, "expected ranks 0..1"),
        ({0: ["0F0", "0B0"], 1: ["0F0", "1B0"]}, "expected stage_index == rank"),
        ({0: ["0F0", "0B0", "0F0"], 1: ["1F0", "1B0"]}, "runs 0F0 twice"),
        ({0: ["0F0", "0B0", "0F1"], 1: ["1F0", "1B0"]}, "expected micro-batch indices 0..0"),
        ({0: ["0RECV_F0", "0F0", "0B0"], 1: ["1F0", "1B0"]}, "stage -1 does not exist"),
    ],
)
def test_validate_structural_errors(rows: dict[int, list[str]], needle: str) -> None:
    with pytest.raises(ScheduleError) as info:
        validate(parse(rows), 2, 1)
    assert needle in str(info.value)
    assert len(str(info.value).splitlines()) >= 3


def test_validate_rejects_foreign_objects() -> None:
    schedule = gpipe(2, 1)
    schedule[0][0] = "0F0"  # type: ignore[call-overload]
    with pytest.raises(ScheduleError, match="expected an Action or None"):
        validate(schedule, 2, 1)


def test_none_slots_are_ignored() -> None:
    schedule = one_f_one_b(2, 2)
    schedule[1] = [None, *schedule[1], None]
    validate(schedule, 2, 2)
    assert simulate(schedule) == simulate(one_f_one_b(2, 2))
    assert lower(schedule) == lower(one_f_one_b(2, 2))
    with pytest.raises(ScheduleError, match="already has communication"):
        lower(lower(schedule))


# --- purity -------------------------------------------------------------------------------------


def test_schedule_package_imports_no_torch() -> None:
    package_dir = Path(str(schedule_pkg.__file__)).parent
    for path in package_dir.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(name.split(".")[0] == "torch" for name in names), path

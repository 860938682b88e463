"""[Note: ZeRO inside stages]: which backward of a rank's program reduce-scatters, read from the
schedule itself (no processes)."""

from __future__ import annotations

import pytest

from polytrain.pipeline.schedule import Action, ActionKind, build_staged, last_backwards, lower


def _programs(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    compute, stage_map = build_staged(name, p, m, virtual_stages=v)
    lowered = lower(compute, stage_map=stage_map)
    return [[a for a in lowered[r] if a is not None] for r in range(p)]


@pytest.mark.parametrize(
    ("name", "p", "m", "v"),
    [("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 2, 1), ("interleaved-1f1b", 2, 4, 2)],
)
def test_each_stage_reduces_after_its_last_backward(name: str, p: int, m: int, v: int) -> None:
    """Every stage a rank holds has exactly one last backward, that of its last micro-batch in
    program order, and no B of that stage follows it."""
    for program in _programs(name, p, m, v):
        last = last_backwards(program)
        stages = {a.stage_index for a in program if a.kind is ActionKind.B}
        assert set(last) == stages and len(stages) == v
        for stage, micro in last.items():
            order = [
                a.microbatch_index
                for a in program
                if a.kind is ActionKind.B and a.stage_index == stage
            ]
            assert order[-1] == micro and sorted(order) == list(range(m))


def test_a_program_without_full_backwards_has_none() -> None:
    """ZB-H1 splits each backward into I and W: no ``B`` to reduce after (refused with ZeRO in
    pipeline.checks)."""
    assert all(last_backwards(program) == {} for program in _programs("zb-h1", 2, 4))

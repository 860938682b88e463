"""Deadlines scale with the machine's measured slowdown (polytrain.testing.speed)."""

from __future__ import annotations

import pytest

from polytrain.testing import scaled, slowdown, speed


class _FakeClocks:
    """Each workload round takes ``cpu_s`` of CPU time and ``wall_s`` of wall time."""

    def __init__(self, wall_s: float, cpu_s: float) -> None:
        self.wall_s, self.cpu_s = wall_s, cpu_s
        self.wall = self.cpu = 0.0
        self.calls = 0

    def perf_counter(self) -> float:
        self.calls += 1
        if self.calls % 2 == 0:  # the second reading of a round: the round has run
            self.wall += self.wall_s
        return self.wall

    def process_time(self) -> float:
        if self.calls % 2 == 0:
            self.cpu += self.cpu_s
        return self.cpu

    def monotonic(self) -> float:
        return 0.0


@pytest.mark.parametrize(
    ("wall_s", "cpu_s", "expected"),
    [
        (speed.REFERENCE_CPU_S, speed.REFERENCE_CPU_S, 1.0),  # idle reference machine
        (3 * speed.REFERENCE_CPU_S, speed.REFERENCE_CPU_S, 3.0),  # a third of a core
        (speed.REFERENCE_CPU_S / 2, speed.REFERENCE_CPU_S / 2, 1.0),  # faster: never shrinks
        (4 * speed.REFERENCE_CPU_S, 2 * speed.REFERENCE_CPU_S, 4.0),  # half speed, half a core
        (100 * speed.REFERENCE_CPU_S, speed.REFERENCE_CPU_S, speed.MAX_SLOWDOWN),  # clamped
    ],
)
def test_slowdown_is_contention_times_cpu_speed(
    monkeypatch: pytest.MonkeyPatch, wall_s: float, cpu_s: float, expected: float
) -> None:
    clocks = _FakeClocks(wall_s, cpu_s)
    monkeypatch.setattr(speed, "time", clocks)
    monkeypatch.setattr(speed, "_workload", lambda: 0)
    monkeypatch.setattr(speed, "_cache", None)  # restored afterwards: no fake value leaks
    assert slowdown(fresh=True) == pytest.approx(expected)
    assert scaled(5.0) == pytest.approx(5.0 * expected)


def test_the_real_measurement_is_within_bounds() -> None:
    assert 1.0 <= slowdown(fresh=True) <= speed.MAX_SLOWDOWN

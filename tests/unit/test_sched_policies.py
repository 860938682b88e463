"""Scheduling policies with a fake clock: each policy's rule, starvation freedom, slice-only
preemption, elastic resizing against the restart cost, and disjoint placements."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from polytrain.errors import ConfigError
from polytrain.scheduler.jobs import JobState, JobView, advance
from polytrain.scheduler.policies import (
    POLICIES,
    Fifo,
    Gandiva,
    Goodput,
    Srtf,
    Tiresias,
    get_policy,
)
from polytrain.scheduler.policy import Allocation, Cluster, Policy, check_allocation
from polytrain.scheduler.simulate import simulate
from polytrain.scheduler.trace import TraceJob

RUNNING, QUEUED, SUSPENDED = JobState.RUNNING, JobState.QUEUED, JobState.SUSPENDED


def job(id: str, **fields: Any) -> JobView:
    return JobView(
        id=id, submitted=fields.pop("submitted", 0.0), devices=fields.pop("devices", 1), **fields
    )


def decide(
    policy: Policy, jobs: Sequence[JobView], devices: int, now: float, slice_s: float = 100.0
) -> dict[str, int]:
    cluster = Cluster(devices, slice_s)
    out = policy.decide(jobs, cluster, now)
    check_allocation(out, jobs, cluster)
    return {k: v for k, v in out.items() if v}


def test_fifo_blocks_behind_the_head_and_backfill_does_not() -> None:
    jobs = [
        job("big", devices=3, state=RUNNING, allocated=3, started=0.0),
        job("two", submitted=1.0, devices=2),
        job("one", submitted=2.0, devices=1),
    ]
    assert decide(Fifo(), jobs, 4, 5.0) == {"big": 3}  # head-of-line blocking: "one" waits
    assert decide(Fifo(backfill=True), jobs, 4, 5.0) == {"big": 3, "one": 1}


def test_fifo_never_preempts() -> None:
    jobs = [job("late", submitted=9.0, state=RUNNING, allocated=1, started=9.0), job("early")]
    assert decide(Fifo(), jobs, 1, 10.0) == {"late": 1}


def test_srtf_preempts_for_the_shorter_job() -> None:
    jobs = [
        job("long", state=RUNNING, allocated=1, started=0.0, remaining=100.0),
        job("short", submitted=5.0, remaining=10.0),
    ]
    assert decide(Srtf(), jobs, 1, 5.0) == {"short": 1}


def test_tiresias_serves_least_attained_queue_first_then_fifo() -> None:
    old = job(
        "old",
        devices=2,
        state=RUNNING,
        allocated=2,
        started=0.0,
        attained=4000.0,
        executed_s=2000.0,
    )
    new_a = job("a", submitted=3.0, devices=2)
    new_b = job("b", submitted=4.0, devices=2)
    assert decide(Tiresias(), [old, new_b, new_a], 2, 2000.0) == {"a": 2}
    assert decide(Tiresias(thresholds=(5000.0,)), [old, new_a], 2, 2000.0) == {"old": 2}


def test_tiresias_promotes_a_job_that_waited_starve_times_its_executed_time() -> None:
    waited = job("waited", state=SUSPENDED, attained=4000.0, executed_s=400.0, last_stopped=1000.0)
    fresh = job("fresh", submitted=1500.0)
    before, after = 1000.0 + 8 * 400.0 - 1.0, 1000.0 + 8 * 400.0
    assert decide(Tiresias(), [waited, fresh], 1, before) == {"fresh": 1}
    assert decide(Tiresias(), [waited, fresh], 1, after) == {"waited": 1}
    assert decide(Tiresias(starve=0.0), [waited, fresh], 1, after) == {"fresh": 1}


def test_gandiva_preempts_only_at_a_slice_boundary() -> None:
    jobs = [job("a", state=RUNNING, allocated=1, started=0.0), job("b", submitted=1.0)]
    assert decide(Gandiva(), jobs, 1, 50.0) == {"a": 1}
    assert decide(Gandiva(), jobs, 1, 100.0) == {"b": 1}  # b waited longest: its turn
    assert decide(Gandiva(), jobs[:1], 1, 100.0) == {"a": 1}  # alone: no reason to stop


def test_gandiva_takes_turns_least_recently_run_first() -> None:
    jobs = [
        job("ran-late", state=SUSPENDED, last_stopped=90.0),
        job("ran-early", submitted=5.0, state=SUSPENDED, last_stopped=10.0),
        job("running", state=RUNNING, allocated=1, started=10.0),
    ]
    assert decide(Gandiva(), jobs, 1, 200.0) == {"ran-early": 1}
    assert decide(Gandiva(), jobs, 2, 200.0) == {"ran-early": 1, "ran-late": 1}


LINEAR = {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}
FLAT = {1: 1.0, 2: 1.1, 3: 1.15, 4: 1.2}


def test_goodput_gives_devices_by_marginal_speedup() -> None:
    jobs = [
        job("flat", devices=4, speedup=FLAT),
        job("linear", submitted=1.0, devices=4, speedup=LINEAR),
    ]
    assert decide(Goodput(), jobs, 4, 0.0) == {"flat": 1, "linear": 3}
    assert decide(Goodput(), jobs, 1, 0.0) == {"flat": 1}  # admission: least attained, then FIFO


@pytest.mark.parametrize(("restart_s", "grows"), [(100.0, False), (5.0, False), (0.0, True)])
def test_goodput_resizes_only_when_the_gain_beats_the_restart(
    restart_s: float, grows: bool
) -> None:
    # From 2 to 3 devices over a 1000 s slice: 2.01 x (1000 - restart) against 2 x 1000.
    curve = {1: 1.0, 2: 2.0, 3: 2.01, 4: 2.02}
    running = job(
        "r", devices=4, speedup=curve, state=RUNNING, allocated=2, started=0.0, restart_s=restart_s
    )
    out = decide(Goodput(), [running], 4, 500.0, slice_s=1000.0)
    assert out == ({"r": 4} if grows else {"r": 2})  # without a restart every gain counts


@pytest.mark.parametrize(("remaining", "grows"), [(10.0, False), (1000.0, True)])
def test_goodput_does_not_restart_a_job_about_to_finish(remaining: float, grows: bool) -> None:
    # [Note: restart horizon]: 10 s of work left at 4 devices is 20 s at the 2 it holds, less
    # than the 30 s restart; 1000 s left pays for it.
    running = job(
        "r", devices=4, speedup=LINEAR, state=RUNNING, allocated=2, started=0.0,
        restart_s=30.0, remaining=remaining,
    )  # fmt: skip
    out = decide(Goodput(), [running], 4, 500.0, slice_s=1000.0)
    assert out == ({"r": 4} if grows else {"r": 2})


def test_goodput_shrinks_a_running_job_to_admit_a_new_one() -> None:
    running = job("r", devices=4, speedup=LINEAR, state=RUNNING, allocated=4, started=0.0)
    new = job("new", submitted=5.0, devices=4, speedup=LINEAR)
    out = decide(Goodput(), [running, new], 4, 100.0)
    assert out["new"] >= 1 and 1 <= out["r"] < 4 and sum(out.values()) == 4


def _stream(long_s: float, n: int, every: float, short_s: float) -> list[TraceJob]:
    """One long job at 0, then ``n`` short jobs arriving faster than one device serves them."""
    shorts = [TraceJob(f"s{i}", every * (i + 1), short_s, 1, line=i + 3) for i in range(n)]
    return [TraceJob("long", 0.0, long_s, 1, line=2), *shorts]


def _restarts_of_long(policy: Policy) -> list[float]:
    """When the long job of :func:`_stream` got devices again after losing them."""
    trace = _stream(long_s=10_000.0, n=400, every=100.0, short_s=110.0)  # shorts alone: load 1.1
    watch = _Watch(policy)
    simulate(trace, watch, Cluster(1, slice_s=1000.0), restart_s=0.0)
    return [t for t, job_id in watch.started if job_id == "long" and t > 0]


@pytest.mark.parametrize("policy", [Tiresias(), Gandiva()], ids=lambda p: p.name)
def test_a_long_job_is_not_starved_by_a_stream_of_short_ones(policy: Policy) -> None:
    assert any(t < 40_000.0 for t in _restarts_of_long(policy))  # runs while shorts still arrive


def test_without_promotion_tiresias_starves_the_long_job() -> None:
    assert min(_restarts_of_long(Tiresias(starve=0.0))) > 40_000.0  # the test above can fail


def test_fifo_makes_a_small_job_wait_for_a_huge_one() -> None:
    trace = [TraceJob("huge", 0.0, 1000.0, 4, line=2), TraceJob("small", 1.0, 10.0, 1, line=3)]
    small = {r.id: r for r in simulate(trace, Fifo(), Cluster(4)).jobs}["small"]
    assert (small.first_started, small.jct) == (pytest.approx(1000.0), pytest.approx(1009.0))


def _random_trace(rng: random.Random, n: int, devices: int) -> list[TraceJob]:
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(1 / 200.0)
        size = rng.choice([1, 1, 1, 2, 2, 4, devices])
        model = rng.choice(["small", "medium", "large", "xlarge"])
        out.append(
            TraceJob(
                f"j{i}", t, rng.uniform(50.0, 5000.0), size, rng.choice([1, size]), model, i + 2
            )
        )
    return out


class _Watch:
    """Wraps a policy; records each preemption's time (a job running before, not after) and
    each start (a job holding no devices given some)."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.preempted_at: list[float] = []
        self.started: list[tuple[float, str]] = []

    @property
    def name(self) -> str:
        return self.inner.name

    def decide(self, jobs: Sequence[JobView], cluster: Cluster, now: float) -> Allocation:
        out = self.inner.decide(jobs, cluster, now)
        for j in jobs:
            if j.state is RUNNING and j.allocated and out.get(j.id, 0) != j.allocated:
                self.preempted_at.append(now)
            if not j.allocated and out.get(j.id, 0):
                self.started.append((now, j.id))
        return out


@pytest.mark.parametrize("name", list(POLICIES))
def test_random_runs_keep_placements_disjoint_and_every_job_finishes(name: str) -> None:
    devices = 8
    for seed in range(3):
        trace = _random_trace(random.Random(seed), 60, devices)
        watch = _Watch(get_policy(name))
        result = simulate(
            trace, watch, Cluster(devices, 600.0), restart_s=30.0, keep_placements=True
        )
        assert len(result.jobs) == len(trace) and all(
            r.finished >= r.submitted for r in result.jobs
        )
        for placement in result.placements:
            used = [d for ds in placement.values() for d in ds]
            assert len(used) == len(set(used)) <= devices and all(0 <= d < devices for d in used)
        if name == "gandiva":
            assert watch.preempted_at, "no preemption: the slice rule went untested"
            assert all(t % 600.0 == 0 for t in watch.preempted_at), watch.preempted_at
        if name == "fifo":
            assert not watch.preempted_at


def test_illegal_transitions_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="cannot go from queued to suspended"):
        advance("j", QUEUED, SUSPENDED)
    assert advance("j", RUNNING, JobState.PREEMPTING) is JobState.PREEMPTING


def test_check_allocation_refuses_more_than_the_job_asked() -> None:
    with pytest.raises(ConfigError, match="runs on 1..2"):
        check_allocation({"a": 3}, [job("a", devices=2)], Cluster(4))


def test_get_policy_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="choose one of fifo, srtf, tiresias, gandiva, goodput"):
        get_policy("lottery")
    with pytest.raises(ConfigError, match="has no option 'quantum'"):
        get_policy("gandiva", quantum=3)
    assert get_policy("fifo", backfill=True) == Fifo(backfill=True)
    with pytest.raises(ConfigError, match="ascending"):
        Tiresias(thresholds=(10.0, 5.0))

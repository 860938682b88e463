"""The discrete-event simulator against job completion times computed by hand."""

from __future__ import annotations

import pytest

from polytrain.errors import ConfigError
from polytrain.scheduler.policies import Fifo, Goodput, Srtf, get_policy
from polytrain.scheduler.policy import Cluster
from polytrain.scheduler.report import percentile
from polytrain.scheduler.simulate import simulate
from polytrain.scheduler.speedup import PLANNED_MODELS, curve, planned_curves, useful_counts
from polytrain.scheduler.trace import TraceJob

# J1: 2 devices for 100 s from t=0; J2: 1 device, 50 s, t=10; J3: 1 device, 30 s, t=20.
TINY = [
    TraceJob("J1", 0.0, 100.0, 2, 2, line=2),
    TraceJob("J2", 10.0, 50.0, 1, line=3),
    TraceJob("J3", 20.0, 30.0, 1, line=4),
]


def jcts(result: object) -> dict[str, float]:
    return {r.id: r.jct for r in result.jobs}  # type: ignore[attr-defined]


def test_fifo_by_hand() -> None:
    # J1 0-100; then J2 100-150 and J3 100-130.
    result = simulate(TINY, Fifo(), Cluster(2), restart_s=30.0)
    assert jcts(result) == pytest.approx({"J1": 100.0, "J2": 140.0, "J3": 110.0})
    assert result.summary.makespan_s == pytest.approx(150.0)
    assert result.summary.avg_queueing_s == pytest.approx((0 + 90 + 80) / 3)


def test_srtf_by_hand_with_the_restart_cost() -> None:
    # t=10: J2 (50 left) outranks J1 (90 left); J1 needs both devices, so it is preempted.
    # t=20: J3 (30) and J2 (40) run; J3 ends at 50, J2 at 60; J1 resumes at 60, restarts for
    # 30 s, then needs its 90 s: it ends at 180.
    result = simulate(TINY, Srtf(), Cluster(2), restart_s=30.0)
    assert jcts(result) == pytest.approx({"J1": 180.0, "J2": 50.0, "J3": 30.0})
    assert {r.id: r.preemptions for r in result.jobs} == {"J1": 1, "J2": 0, "J3": 0}
    busy = 2 * 10 + 2 * 120 + 50 + 30  # device-seconds held, the restart included
    assert result.summary.utilisation == pytest.approx(busy / (2 * 180))
    assert result.summary.p99_jct_s == pytest.approx(180.0)


def test_goodput_shares_the_devices_and_slows_both_by_the_curve() -> None:
    # Two 2-device jobs of class "small" on 2 devices: each is admitted at 1 device, so each
    # runs at s(1) = 1 its work of duration x s(2) one-device seconds.
    jobs = [
        TraceJob("a", 0.0, 100.0, 2, model="small", line=2),
        TraceJob("b", 0.0, 100.0, 2, model="small", line=3),
    ]
    result = simulate(jobs, Goodput(), Cluster(2), restart_s=30.0)
    assert jcts(result) == pytest.approx(
        {"a": 100.0 * curve("small", 2)[2]} | {"b": 100.0 * curve("small", 2)[2]}
    )
    assert jcts(simulate(jobs, Fifo(), Cluster(2))) == pytest.approx({"a": 100.0, "b": 200.0})


@pytest.mark.parametrize("name", ["fifo", "srtf", "tiresias", "gandiva", "goodput"])
def test_a_job_alone_takes_its_duration_and_is_fairly_treated(name: str) -> None:
    alone = [TraceJob("only", 5.0, 7200.0, 4, 1, "large", line=2)]
    result = simulate(alone, get_policy(name), Cluster(8, slice_s=600.0))
    (record,) = result.jobs
    assert (record.jct, record.queueing, record.preemptions) == (pytest.approx(7200.0), 0.0, 0)
    assert record.rho == pytest.approx(1.0)
    assert result.summary.utilisation == pytest.approx(4 / 8)


def test_gandiva_slices_by_hand() -> None:
    # One device, slice 100 s, restart 10 s: A (t=0, 150 s) and B (t=0, 150 s) alternate.
    # 0-100 A (A: 50 left); 100-200 B (restart 0: a first start; B: 50 left); 200-300 A
    # (restart 10, then 50 s: A ends at 260); 260 B resumes (restart until 270, ends at 320).
    jobs = [TraceJob("A", 0.0, 150.0, 1, line=2), TraceJob("B", 0.0, 150.0, 1, line=3)]
    result = simulate(jobs, get_policy("gandiva"), Cluster(1, slice_s=100.0), restart_s=10.0)
    assert jcts(result) == pytest.approx({"A": 260.0, "B": 320.0})


def test_empty_and_duplicate_traces_are_one_line() -> None:
    with pytest.raises(ConfigError, match="no jobs to simulate"):
        simulate([], Fifo(), Cluster(2))
    with pytest.raises(ConfigError, match="job id 'J2' appears twice"):
        simulate([*TINY, TINY[1]], Fifo(), Cluster(2))
    with pytest.raises(ConfigError, match=r"job 'J1' \(line 2\) asks 2 devices, the cluster has 1"):
        simulate(TINY, Fifo(), Cluster(1))


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 99), percentile(values, 50), percentile([3.0], 99)) == (
        99.0,
        50.0,
        3.0,
    )


def test_elastic_goodput_grows_a_lone_job_past_its_ask_and_others_never_do() -> None:
    """A lone 1-device job on 4 idle devices: the elastic goodput policy gives it all 4 (its
    curve's speed-up at 4 shortens the job exactly), FIFO keeps it on its ask either way."""
    lone = [TraceJob("J", 0.0, 1000.0, 1, model="small", line=2)]
    cluster = Cluster(4, 600.0)
    s4 = curve("small", 4)[4]
    elastic = simulate(lone, Goodput(), cluster, restart_s=0.0, elastic=4.0)
    assert elastic.jobs[0].jct == pytest.approx(1000.0 / s4)
    assert simulate(lone, Goodput(), cluster, restart_s=0.0).jobs[0].jct == pytest.approx(1000.0)
    fifo = simulate(lone, Fifo(), cluster, restart_s=0.0, elastic=4.0)
    assert fifo.jobs[0].jct == pytest.approx(1000.0)
    with pytest.raises(ConfigError, match="elastic = 0.5"):
        simulate(lone, Goodput(), cluster, elastic=0.5)


def test_planned_curves_come_from_the_planner_with_a_knee_past_one_host() -> None:
    """Each class's GPT priced data-parallel with the batch fixed: linear-ish inside a host,
    bent where the all-reduce leaves NVLink for InfiniBand; larger models scale further."""
    curves = planned_curves("2x8xV100:ib100")
    assert set(curves) == set(PLANNED_MODELS)
    for speedup in curves.values():
        assert list(speedup) == list(range(1, 17)) and speedup[1] == pytest.approx(1.0)
        assert 1.0 < speedup[2] <= 2.0 and speedup[8] > speedup[4] > speedup[2]
        # the ninth device is on the second host: it adds less than each of the first eight
        assert speedup[9] - speedup[8] < (speedup[8] - 1.0) / 7
    assert curves["small"][9] < curves["small"][8]  # for a small model, less than nothing
    assert curves["small"][16] < curves["medium"][16] < curves["large"][16] < curves["xlarge"][16]


def test_useful_counts_drop_a_count_slower_than_a_smaller_one_but_keep_the_ask() -> None:
    bent = {1: 1.0, 2: 1.9, 3: 1.5, 4: 2.5}
    assert useful_counts(bent, keep=1) == {1: 1.0, 2: 1.9, 4: 2.5}
    assert useful_counts(bent, keep=3) == bent  # a job that asked for 3 runs on 3


def test_a_curve_shorter_than_the_ceiling_is_one_line() -> None:
    curves = {"small": {1: 1.0, 2: 1.8}}
    assert curve("small", 2, curves) == {1: 1.0, 2: 1.8}
    with pytest.raises(ConfigError, match="stops at 2 devices, 4 needed"):
        curve("small", 4, curves)

"""Pure parts of the parameter server: wire header, sharding, consistency rules (no processes)."""

from __future__ import annotations

import itertools
import math
import os
import random
import subprocess
import sys

import pytest
import torch

import polytrain
from polytrain.errors import ConfigError, ProtocolError
from polytrain.ps import (
    ApplyRule,
    ClockTable,
    SyncAggregator,
    apply_rule,
    check_consistency,
    check_staleness_trace,
    host_groups,
    leader_of,
    may_proceed,
    plan_shards,
    shard_parameters,
    staleness_bound,
)
from polytrain.ps.protocol import (
    DTYPE_CODES,
    HEADER_FIELDS,
    HEADER_LEN,
    MAGIC,
    PAYLOAD_OPS,
    Header,
    Op,
    chunk_spans,
    dtype_code,
    dtype_from_code,
    job_fingerprint,
)
from polytrain.ps.stats import ServerStats
from polytrain.testing import scaled

JOB = job_fingerprint([("w", (4, 3), "torch.float32"), ("b", (3,), "torch.float32")])
NUM_WORKERS, NUM_SHARDS = 4, 2


def _decode(
    wire: torch.Tensor, expect_numel: int | None = None, expect_ops: set[Op] | None = None
) -> Header:
    return Header.decode(
        wire,
        expect_job=JOB,
        num_workers=NUM_WORKERS,
        num_shards=NUM_SHARDS,
        expect_numel=expect_numel,
        expect_ops=expect_ops,
    )


def _run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter that imports this polytrain; return its stdout."""
    src = os.path.dirname(os.path.dirname(os.path.abspath(polytrain.__file__)))
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=scaled(60),
        env={**os.environ, "PYTHONPATH": path},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def _push(**overrides: int) -> Header:
    fields = {
        "op": Op.PUSH,
        "worker": 3,
        "clock": 7,
        "job_id": JOB,
        "shard": 1,
        "chunk": 2,
        "num_chunks": 3,
        "numel": 100,
        "dtype": DTYPE_CODES[torch.float32],
    }
    return Header(**{**fields, **overrides})  # type: ignore[arg-type]


# --- protocol ------------------------------------------------------------------------------


@pytest.mark.parametrize("op", list(Op))
def test_header_round_trip(op: Op) -> None:
    if op in PAYLOAD_OPS:
        header = _push(op=op)
    else:
        header = Header(op=op, worker=1, clock=5, job_id=JOB, shard=1)
    wire = header.encode()
    assert wire.dtype == torch.int64
    assert wire.shape == (HEADER_LEN,)
    assert _decode(wire) == header


def test_header_wire_order_starts_with_magic() -> None:
    wire = _push().encode().tolist()
    assert wire[0] == MAGIC
    assert wire[HEADER_FIELDS.index("job_id")] == JOB
    assert 0 <= JOB < 2**63


def _mutated(field: str, value: int) -> torch.Tensor:
    wire = _push().encode()
    wire[HEADER_FIELDS.index(field)] = value
    return wire


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("magic", 12345),
        ("version", 99),
        ("op", 99),
        ("worker", 4),
        ("worker", -1),
        ("shard", 2),
        ("chunk", 3),
        ("num_chunks", 0),
        ("clock", -1),
        ("numel", 0),
        ("numel", -5),
        ("dtype", 77),
        ("dtype", 0),
        ("job_id", JOB ^ 1),
    ],
)
def test_decode_rejects_bad_field(field: str, value: int) -> None:
    with pytest.raises(ProtocolError, match=rf"\b{field}\b") as info:
        _decode(_mutated(field, value))
    message = str(info.value)
    assert "\n" not in message
    assert "expected" in message


def test_decode_rejects_job_mismatch_with_both_fingerprints() -> None:
    other = job_fingerprint([("w", (4, 4), "torch.float32")])
    with pytest.raises(ProtocolError, match="job_id") as info:
        _decode(_push(job_id=other).encode())
    assert f"{other:#x}" in str(info.value)
    assert f"{JOB:#x}" in str(info.value)


@pytest.mark.parametrize(
    "wire",
    [
        torch.zeros(HEADER_LEN - 1, dtype=torch.int64),  # truncated
        torch.zeros(HEADER_LEN + 1, dtype=torch.int64),
        torch.zeros(1, HEADER_LEN, dtype=torch.int64),
    ],
)
def test_decode_rejects_wrong_length(wire: torch.Tensor) -> None:
    with pytest.raises(ProtocolError, match="header length"):
        _decode(wire)


def test_decode_rejects_truncated_real_header() -> None:
    with pytest.raises(ProtocolError, match="truncated"):
        _decode(_push().encode()[:-1])


def test_decode_rejects_wrong_dtype() -> None:
    with pytest.raises(ProtocolError, match="header dtype"):
        _decode(_push().encode().to(torch.float64))


def test_decode_checks_expected_numel_and_ops() -> None:
    _decode(_push().encode(), expect_numel=100)
    with pytest.raises(ProtocolError, match="numel = 100: expected 64"):
        _decode(_push().encode(), expect_numel=64)
    with pytest.raises(ProtocolError, match="op = PUSH: expected one of PULL"):
        _decode(_push().encode(), expect_ops={Op.PULL})


def test_header_without_payload_must_not_announce_one() -> None:
    with pytest.raises(ProtocolError, match="numel"):
        Header(op=Op.CLOCK, worker=0, clock=1, job_id=JOB, numel=4)
    with pytest.raises(ProtocolError, match="dtype"):
        Header(op=Op.PULL, worker=0, clock=1, job_id=JOB, dtype=1)


def test_check_payload() -> None:
    header = _push(numel=6, dtype=dtype_code(torch.bfloat16))
    header.check_payload(torch.zeros(2, 3, dtype=torch.bfloat16))
    with pytest.raises(ProtocolError, match="payload dtype"):
        header.check_payload(torch.zeros(6))
    with pytest.raises(ProtocolError, match="payload numel"):
        header.check_payload(torch.zeros(5, dtype=torch.bfloat16))
    with pytest.raises(ProtocolError, match="no payload"):
        Header(op=Op.ACK, worker=0, clock=0, job_id=JOB).check_payload(torch.zeros(1))


def test_dtype_codes() -> None:
    assert set(DTYPE_CODES) == {
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
    }
    for dtype in DTYPE_CODES:
        assert dtype_from_code(dtype_code(dtype)) == dtype
    with pytest.raises(ProtocolError, match="int8"):
        dtype_code(torch.int8)
    with pytest.raises(ProtocolError, match="dtype = 0"):
        dtype_from_code(0)


def test_job_fingerprint_is_stable_and_sensitive() -> None:
    shapes = [("w", (4, 3), "torch.float32"), ("b", (3,), "torch.float32")]
    # Pinned: the fingerprint is part of the wire format; it must not change between releases
    # or depend on the process (no salted ``hash``).
    assert job_fingerprint(shapes) == JOB == 4777470237013517428
    variants = [
        [("w", (3, 4), "torch.float32"), ("b", (3,), "torch.float32")],
        [("w", (4, 3), "torch.float16"), ("b", (3,), "torch.float32")],
        [("v", (4, 3), "torch.float32"), ("b", (3,), "torch.float32")],
        list(reversed(shapes)),
    ]
    prints = {job_fingerprint(v) for v in variants} | {JOB, job_fingerprint(shapes, "servers=2")}
    assert len(prints) == len(variants) + 2
    assert all(0 <= p < 2**63 for p in prints)


def test_job_fingerprint_same_in_another_process() -> None:
    code = (
        "from polytrain.ps.protocol import job_fingerprint;"
        "print(job_fingerprint([('w', (4, 3), 'torch.float32'), ('b', (3,), 'torch.float32')]))"
    )
    assert int(_run_python(code)) == JOB


@pytest.mark.parametrize(("numel", "chunk"), [(10, 3), (9, 3), (1, 5), (5, 1), (0, 4), (7, 7)])
def test_chunk_spans_cover_exactly(numel: int, chunk: int) -> None:
    spans = chunk_spans(numel, chunk)
    covered = [i for start, stop in spans for i in range(start, stop)]
    assert covered == list(range(numel))
    assert all(0 < stop - start <= chunk for start, stop in spans)
    assert all(stop - start == chunk for start, stop in spans[:-1])
    assert len(spans) == -(-numel // chunk)


def test_chunk_spans_rejects_bad_sizes() -> None:
    with pytest.raises(ProtocolError, match="chunk_elems = 0"):
        chunk_spans(10, 0)
    with pytest.raises(ProtocolError, match="numel = -1"):
        chunk_spans(-1, 4)


def test_pure_modules_do_not_import_torch() -> None:
    code = (
        "import sys, polytrain.ps, polytrain.ps.sharding, polytrain.ps.consistency;"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    _run_python(code)


# --- sharding ------------------------------------------------------------------------------


def test_sharding_many_equal_params_is_balanced() -> None:
    params = [(f"layer{i}.weight", 4096) for i in range(64)]
    plan = plan_shards(params, 4)
    assert plan.imbalance == pytest.approx(1.0)
    assert [len(names) for names in plan.assignment] == [16, 16, 16, 16]
    plan = plan_shards([(f"p{i}", 1000 + i) for i in range(100)], 4)
    assert plan.imbalance < 1.01


def test_sharding_big_param_sits_alone() -> None:
    params = [("embed", 10_000), *[(f"p{i}", 100) for i in range(10)]]
    assignment = shard_parameters(params, 3)
    plan = plan_shards(params, 3)
    assert ["embed"] in assignment
    assert plan.server_of("embed") == 0
    assert plan.server_bytes[0] == 10_000
    assert sorted(plan.server_bytes[1:]) == [500, 500]


def test_sharding_is_deterministic_and_complete() -> None:
    params = [(f"p{i}", (i * 37) % 11 * 8) for i in range(40)]
    first = shard_parameters(params, 5)
    assert first == shard_parameters(params, 5)
    assert sorted(itertools.chain(*first)) == sorted(name for name, _ in params)
    shuffled = params[:]
    random.Random(0).shuffle(shuffled)
    # Same servers get the same sets whatever the input order ([Note: determinism]).
    assert [set(s) for s in shard_parameters(shuffled, 5)] == [set(s) for s in first]
    # Within a server, names keep the caller's order.
    order = {name: i for i, (name, _) in enumerate(params)}
    assert all(names == sorted(names, key=order.__getitem__) for names in first)
    plan = plan_shards(params, 5)
    for server, names in enumerate(plan.assignment):
        assert all(plan.server_of(n) == server for n in names)


def test_sharding_errors() -> None:
    with pytest.raises(ConfigError, match=r"ps.servers = 0"):
        plan_shards([("a", 4)], 0)
    with pytest.raises(ConfigError, match=r"ps.servers = 3 exceeds the 2 parameters.*<= 2"):
        plan_shards([("a", 4), ("b", 4)], 3)
    with pytest.raises(ConfigError, match="twice"):
        plan_shards([("a", 4), ("a", 4)], 1)
    with pytest.raises(ConfigError, match="nbytes = -1"):
        plan_shards([("a", -1)], 1)
    with pytest.raises(ConfigError, match="'zzz' is not in the shard plan"):
        plan_shards([("a", 4)], 1).server_of("zzz")


def test_host_groups_and_leaders() -> None:
    # Ranks 0 and 1 are servers on host 0; workers are 2..9 with 4 ranks per host.
    groups = host_groups([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert groups == [[2, 3], [4, 5, 6, 7], [8, 9]]
    assert [leader_of(g) for g in groups] == [2, 4, 8]
    assert host_groups([], 4) == []
    assert host_groups([0, 1, 2], 1) == [[0], [1], [2]]
    with pytest.raises(ConfigError, match="ranks_per_host = 0"):
        host_groups([0], 0)
    with pytest.raises(ConfigError, match="duplicates"):
        host_groups([1, 1], 2)
    with pytest.raises(ConfigError, match="empty host group"):
        leader_of([])


# --- consistency ---------------------------------------------------------------------------


def test_clock_table_with_join_and_leave() -> None:
    table = ClockTable([0, 1, 2])
    assert table.min_clock() == 0
    assert table.advance(0) == 1
    assert table.advance(0, finished=1) == 2
    assert table.advance(1) == 1
    assert table.staleness(0) == 2
    assert table.min_clock() == 0  # worker 2 still at 0
    table.remove_worker(2)  # the slowest leaves: nobody waits for it
    assert table.min_clock() == 1
    assert table.staleness(0) == 1
    assert table.add_worker(3) == 1  # joins at min_clock
    assert table.workers == [0, 1, 3]
    assert 2 not in table and 3 in table and len(table) == 3
    with pytest.raises(ProtocolError, match="clock >= min_clock = 1"):
        table.add_worker(4, clock=0)
    with pytest.raises(ProtocolError, match="already live"):
        table.add_worker(3)
    with pytest.raises(ProtocolError, match="worker 2 is not live"):
        table.advance(2)
    with pytest.raises(ProtocolError, match="finished clock 5: expected 2"):
        table.advance(0, finished=5)
    table.advance(1)
    table.advance(3)
    assert table.min_clock() == 2
    for worker in table.workers:
        table.remove_worker(worker)
    assert len(table) == 0
    assert table.min_clock() == 2  # the floor never goes back
    assert table.add_worker(6) == 2


@pytest.mark.parametrize(
    ("worker_clock", "min_clock", "sync", "asynchronous", "ssp1", "ssp3"),
    [
        (0, 0, True, True, True, True),
        (1, 0, False, True, True, True),
        (2, 0, False, True, False, True),
        (3, 0, False, True, False, True),
        (4, 0, False, True, False, False),
        (5, 4, False, True, True, True),
        (9, 5, False, True, False, False),
        (7, 7, True, True, True, True),
    ],
)
def test_may_proceed_table(
    worker_clock: int, min_clock: int, sync: bool, asynchronous: bool, ssp1: bool, ssp3: bool
) -> None:
    assert may_proceed("sync", 0, worker_clock, min_clock) is sync
    assert may_proceed("async", 0, worker_clock, min_clock) is asynchronous
    assert may_proceed("ssp", 1, worker_clock, min_clock) is ssp1
    assert may_proceed("ssp", 3, worker_clock, min_clock) is ssp3


def test_ssp_zero_equals_sync() -> None:
    for worker_clock, min_clock in itertools.product(range(6), range(6)):
        assert may_proceed("ssp", 0, worker_clock, min_clock) == may_proceed(
            "sync", 0, worker_clock, min_clock
        )
    assert apply_rule("ssp", 0) is apply_rule("sync") is ApplyRule.SUM_THEN_APPLY
    assert apply_rule("ssp", 2) is apply_rule("async") is ApplyRule.APPLY_ON_ARRIVAL
    assert staleness_bound("sync") == 0
    assert staleness_bound("async") is None
    assert staleness_bound("ssp", 4) == 4


def test_consistency_config_errors() -> None:
    check_consistency("ssp", 3)
    check_consistency("sync", 0)
    with pytest.raises(ConfigError, match=r"ps.staleness = -1: expected a non-negative"):
        check_consistency("ssp", -1)
    with pytest.raises(ConfigError, match=r"ps.staleness = 2 has no effect with ps.mode = 'sync'"):
        check_consistency("sync", 2)
    with pytest.raises(ConfigError, match=r"set ps.mode = 'ssp'"):
        may_proceed("async", 1, 0, 0)
    with pytest.raises(ConfigError, match=r"ps.mode = 'hogwild': expected one of sync, async, ssp"):
        check_consistency("hogwild")


def test_sync_aggregator_with_leaving_and_joining_worker() -> None:
    agg = SyncAggregator([0, 1, 2])
    assert not agg.add(0, clock=0)
    assert not agg.add(2, clock=0)
    assert agg.pending == {1}
    assert agg.remove_worker(1)  # worker 1 leaves mid-clock: no longer awaited
    assert agg.finish() == 2
    assert agg.clock == 1 and agg.pending == {0, 2}
    assert not agg.add(0, clock=1)
    assert agg.add_worker(5) == 1  # a joiner contributes from the clock being collected
    assert not agg.add(2, clock=1)
    assert agg.add(5, clock=1)
    assert agg.finish() == 3
    # A worker that pushed and then left stays in the sum.
    assert not agg.add(0, clock=2)
    assert not agg.remove_worker(0)
    assert agg.arrived == {0}
    assert not agg.add(2, clock=2)
    assert agg.add(5, clock=2)
    assert agg.finish() == 3


def test_sync_aggregator_rejects_bad_pushes() -> None:
    agg = SyncAggregator([0, 1])
    agg.add(0, clock=0)
    with pytest.raises(ProtocolError, match="already pushed"):
        agg.add(0, clock=0)
    with pytest.raises(ProtocolError, match="of clock 1: expected clock 0"):
        agg.add(1, clock=1)
    with pytest.raises(ProtocolError, match="worker 7: it is not live"):
        agg.add(7, clock=0)
    with pytest.raises(ProtocolError, match="LEAVE from worker 7"):
        agg.remove_worker(7)


def test_check_staleness_trace_finds_violation() -> None:
    trace = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 2, 0), (1, 1, 1), (0, 3, 1)]
    assert check_staleness_trace(trace, 2) == []
    violations = check_staleness_trace(trace, 1)
    assert [(v.index, v.worker, v.staleness) for v in violations] == [(3, 0, 2), (5, 0, 2)]
    assert "staleness 2 > bound 1" in str(violations[0])
    assert len(check_staleness_trace(trace, 0)) == 3
    with pytest.raises(ConfigError, match="bound = -1"):
        check_staleness_trace(trace, -1)


@pytest.mark.parametrize("bound", [0, 1, 3])
def test_simulated_ssp_run_respects_bound(bound: int) -> None:
    """Random speeds; workers start an iteration only when may_proceed allows it."""
    rng = random.Random(bound)
    table = ClockTable(range(4))
    trace: list[tuple[int, int, int]] = []
    for _ in range(400):
        worker = rng.choice(table.workers)
        if may_proceed("ssp", bound, table.clock(worker), table.min_clock()):
            trace.append((worker, table.clock(worker), table.min_clock()))
            table.advance(worker)
    assert check_staleness_trace(trace, bound) == []
    assert max(c - m for _, c, m in trace) == bound


def test_automatic_chunk_size_is_bounded_by_the_shard() -> None:
    """ps.chunk_kb = 0 (the default): the whole shard up to 4 MiB, then 4 MiB chunks ([Note:
    automatic chunk size]: on loopback one chunk beat four on the default job's shard)."""
    from torch import nn

    from polytrain.config.job import PSConfig
    from polytrain.ps.layout import AUTO_CHUNK_MAX, AUTO_CHUNK_MIN, auto_chunk_bytes, build_layout

    assert PSConfig().chunk_kb == 0
    assert auto_chunk_bytes(100) == AUTO_CHUNK_MIN  # a small shard: one chunk of it
    assert auto_chunk_bytes(3 << 20) == 3 << 20
    assert auto_chunk_bytes(16 << 20) == AUTO_CHUNK_MAX == 4 << 20
    model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512))  # 4 MiB + biases
    small = build_layout(model, 2, PSConfig().chunk_kb)  # two shards of about 2 MiB
    assert all(len(small.spans(s)) == 1 for s in range(2))
    model = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024))  # 16 MiB + biases
    layout = build_layout(model, 1, PSConfig().chunk_kb)
    assert layout.chunk_elems * 4 == AUTO_CHUNK_MAX
    assert len(layout.spans(0)) == -(-layout.numel(0) // layout.chunk_elems) == 5
    fixed = build_layout(model, 1, 64)
    assert fixed.chunk_elems * 4 == 64 * 1024 and fixed.job_id != layout.job_id


def test_chunk_size_from_a_calibrated_link() -> None:
    """[Note: chunk size from the link]: among the sizes reaching 90% of the best rate (the
    runtime's price per chunk included), the smallest taking at least LINK_CHUNK_MIN_S, else the
    largest; at most the largest shard, at least LINK_CHUNK_MIN; the fixed rule without a
    usable curve, and never when ps.chunk_kb is set."""
    from torch import nn

    from polytrain.ps.layout import LINK_CHUNK_MIN, auto_chunk_bytes, build_layout, link_chunk_bytes

    kib, mib = 1 << 10, 1 << 20
    # The VM's measured rates (GB/s): best at 1 MiB raw, lower past it; with the runtime's
    # 1 ms per chunk the rates are 0.66 (1 MiB), 1.02 (4 MiB), 1.00 (16 MiB): 4 and 16 MiB are
    # efficient and only 16 MiB takes 5 ms.
    vm = [
        (b, b / (r * 1e9))
        for b, r in [
            (64 * kib, 0.41),
            (256 * kib, 0.98),
            (mib, 1.78),
            (4 * mib, 1.34),
            (16 * mib, 1.06),
        ]
    ]
    assert link_chunk_bytes(vm, 44 * mib) == 16 * mib
    assert link_chunk_bytes(vm, 3 * mib) == 3 * mib  # the default job's shard: one chunk
    # (Raw rates alone pick 1 MiB here, the only size within 90% of the best: a busy probe did
    # so in 4 of 14 runs on 2026-11-25, and those runs stepped 10-20% slower.)
    assert link_chunk_bytes(vm, 700 * kib) == 700 * kib  # the whole shard, one chunk
    assert link_chunk_bytes(vm, 10 * kib) == LINK_CHUNK_MIN
    # An alpha-beta link (50 us, 1 GB/s): 90% of the peak needs b >= 9 * alpha * B = 450 kB,
    # 5 ms of transfer 5 MB: the first size past both is 16 MiB (4 MiB takes 4.2 ms).
    ab = [(float(b), 50e-6 + b / 1e9) for b in (4 * kib * 4**i for i in range(8))]
    assert link_chunk_bytes(ab, 1 << 30) == 16 * mib
    # A 200 Mbit/s link (25 MB/s): every size from 16 KiB is efficient; 256 KiB takes 10 ms.
    slow = [(float(b), 50e-6 + b / 25e6) for b in (16 * kib * 4**i for i in range(4))]
    assert link_chunk_bytes(slow, 1 << 30) == 256 * kib
    # Loopback-like (3 GB/s, flat past 1 MiB): no size takes 5 ms, so the largest efficient one.
    fast = [(float(b), 100e-6 + b / 3e9) for b in (mib, 4 * mib, 16 * mib)]
    assert link_chunk_bytes(fast, 1 << 30) == 16 * mib
    assert link_chunk_bytes(fast, 3 * mib) == 3 * mib  # the default job's shard: one chunk
    assert link_chunk_bytes(ab[:1], 1 << 30) is None
    assert link_chunk_bytes([], 1 << 30) is None
    model = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024))  # 16 MiB + biases
    largest = build_layout(model, 1, 0).plan.server_bytes[0]
    assert build_layout(model, 1, 0, link=vm).chunk_elems * 4 == 16 * mib
    assert build_layout(model, 1, 0, link=vm[:1]).chunk_elems * 4 == auto_chunk_bytes(largest)
    assert build_layout(model, 1, 64, link=vm).chunk_elems * 4 == 64 * kib


def test_transfer_windows_divide_bytes_by_the_time_inside_them() -> None:
    """[Note: transfer windows]: per clock the push window plus the pull window; clocks before
    ``first_clock`` and halves that moved nothing are left out."""
    stats = ServerStats()
    stats.window(0).push_start, stats.window(0).push_end = 0.0, 100.0  # warm-up: left out
    stats.window(0).push_bytes = 1
    w1 = stats.window(1)
    w1.push_start, w1.push_end, w1.push_bytes = 10.0, 12.0, 400
    w1.pull_start, w1.pull_end, w1.pull_bytes = 13.0, 14.0, 200
    w2 = stats.window(2)  # a pull only (a final evaluation's): its push half counts nothing
    w2.pull_start, w2.pull_end, w2.pull_bytes = 20.0, 21.0, 200
    assert w1.seconds() == 3.0 and w2.seconds() == 1.0
    assert stats.window_bytes_per_s() == pytest.approx((400 + 200 + 200) / 4.0)
    assert stats.window_bytes_per_s(first_clock=0) == pytest.approx(801 / 104.0)
    assert stats.window_bytes_per_s(which="pull") == pytest.approx(400 / 2.0)
    assert stats.window_bytes_per_s(which="push") == pytest.approx(400 / 2.0)
    assert math.isnan(ServerStats().window_bytes_per_s())
    record = w2.record()  # JSON-ready: the push half's infinite bounds are dropped
    assert "push_start" not in record and record["pull_bytes"] == 200.0

"""Parameter servers on gloo ranks: sync parity, async/ssp quality, staleness bound, faults.

Servers are the last ``ps.servers`` ranks; workers the others (polytrain.ps.strategy).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from polytrain.errors import ProtocolError
from polytrain.ps import check_staleness_trace
from polytrain.testing import assert_state_close, run_distributed, run_job
from tests.conftest import small_job
from tests.helpers.kill_rank import train_and_kill

pytestmark = pytest.mark.slow


def _server_stats(out_dir: str, num_servers: int) -> list[dict[str, Any]]:
    return [
        json.loads((Path(out_dir) / "ps" / f"server{i}.json").read_text())
        for i in range(num_servers)
    ]


ADAMW_CLIP = {"name": "adamw", "lr": 3e-3, "grad_clip": 0.5, "weight_decay": 0.1}


@pytest.mark.parametrize(
    ("world", "ps", "optim", "batch"),
    [
        (3, {"servers": 1}, {}, 16),
        # Two servers, many chunks per shard, AdamW with global-norm clipping across servers.
        (4, {"servers": 2, "chunk_kb": 8}, ADAMW_CLIP, 16),
        # Hierarchical: hosts of 2 ranks -> worker groups [0, 1] and [2]; leaders 0 and 2.
        (4, {"servers": 1, "hierarchical": True, "ranks_per_host": 2}, {}, 12),
        # Colocated ([Note: colocated servers]): both ranks work and serve a shard each...
        (2, {"servers": 2, "chunk_kb": 8, "colocate": True}, ADAMW_CLIP, 16),
        # ... and 2 of 3 ranks serve, so rank 2 only works (all-remote pushes).
        (3, {"servers": 2, "colocate": True}, {}, 12),
    ],
    ids=[
        "1server",
        "2servers-chunked-adamw-clip",
        "hierarchical",
        "colocated-chunked-adamw-clip",
        "colocated-2of3",
    ],
)
def test_sync_matches_single_process(
    world: int, ps: dict[str, Any], optim: dict[str, Any], batch: int
) -> None:
    train = {"global_batch_size": batch}
    ref = run_job(small_job(optim=optim, train=train))
    job = small_job(
        parallel={"sync": "ps"}, ps=ps, optim=optim, train=train, launch={"nproc": world}
    )
    out = run_job(job)
    assert out["strategy"].startswith("ps-sync")
    assert out["strategy"].endswith("-colocated") == bool(ps.get("colocate"))
    assert_state_close(out["state"], ref["state"], atol=1e-5)
    assert out["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    if not ps.get("hierarchical"):  # [Note: prioritised overlap]: pushed from backward hooks
        early = [r["ps_early_chunks"] for r in out["history"] if "ps_early_chunks" in r]
        assert early and min(early) > 0


def _quality_job(out_dir: str, **ps: Any) -> Any:
    return small_job(
        parallel={"sync": "ps"},
        ps={"servers": 1, **ps},
        launch={"nproc": 3},
        train={"steps": 120, "eval_batches": 8},
        optim={"lr": 0.2, "momentum": 0.0},
        observe={"out_dir": out_dir},
    )


def test_async_and_ssp_reach_sync_quality_within_bound(tmp_path: Path) -> None:
    """Same samples (steps x global batch); validation loss within 5% of sync; SSP bound holds."""
    results = {}
    for name, ps in [
        ("sync", {"mode": "sync"}),
        ("async", {"mode": "async"}),
        ("ssp", {"mode": "ssp", "staleness": 1}),
    ]:
        out_dir = str(tmp_path / name)
        results[name] = run_job(_quality_job(out_dir, **ps))["val_loss"]
        (stats,) = _server_stats(out_dir, 1)
        events = [tuple(e) for e in stats["events"]]
        # Every grant of every worker was recorded: 2 workers x (120 steps + final eval pull).
        assert len(events) >= 2 * 120
        bound = {"sync": 0, "ssp": 1}.get(name)
        if bound is not None:
            assert check_staleness_trace(events, bound) == [], name
        if name == "sync":
            assert stats["updates"] == 120
        else:
            assert stats["updates"] == 2 * 120  # one update per push
    for name in ("async", "ssp"):
        assert abs(results[name] - results["sync"]) <= 0.05 * results["sync"], results


def test_async_survives_killed_worker_and_admits_joiner(tmp_path: Path) -> None:
    """Kill worker 1 (SIGKILL, by pid) mid-run; worker 2 joins late; the run finishes."""
    out_dir = str(tmp_path / "run")
    job = small_job(
        parallel={"sync": "ps"},
        ps={"servers": 1, "mode": "async", "spare_workers": 1, "join_delay_s": 2.5},
        launch={"nproc": 4},
        train={"steps": 400, "eval_batches": 2, "global_batch_size": 12},
        observe={"out_dir": out_dir, "log_every": 1},
    )
    world, victim = 4, 1
    out, code = train_and_kill(job, world, victim, tmp_path, after_steps=40)
    assert code == -signal.SIGKILL
    assert out[0]["steps"] == 400 and out[0]["val_loss"] < 4.5
    (stats,) = _server_stats(out_dir, 1)
    removed = {w: (clock, why) for w, clock, why in stats["removed"]}
    assert victim in removed and 0 < removed[victim][0] < 400, removed
    assert "gone" in removed[victim][1] or "lost" in removed[victim][1]
    joined = dict(stats["joined"])
    assert joined.get(2, 0) > 0, stats["joined"]  # admitted mid-run at the current clock
    assert sorted(w for w, _ in stats["left"]) == [0, 2]
    granted = {w for w, _, _ in stats["events"]}
    assert granted == {0, 1, 2}  # the victim before its death, the joiner after it came


# --- bad messages ---------------------------------------------------------------------------


BAD_CASES = {
    "bad-magic": "magic = 0x4d2",
    "other-job": "job_id",
    "short-payload": "shorter than its header",
    "long-payload": "longer than its header",
}


def _bad_message_rank(rank: int, world_size: int) -> Any:
    """Rank 0 is a rogue worker sending one bad message per case; rank 1 a fresh server each."""
    from polytrain.comm import ps_wire
    from polytrain.data.datasets import build_datasets
    from polytrain.models.registry import build_model
    from polytrain.ps.layout import build_layout
    from polytrain.ps.protocol import Header, Op
    from polytrain.ps.server import ParameterServer

    job = small_job()
    _, _, spec = build_datasets(job.data, 16)
    model = build_model(job.model, spec, 0)
    layout = build_layout(model, 1, 4)
    spans = layout.spans(0)
    n = spans[0][1] - spans[0][0]
    out = {}
    for case in BAD_CASES:
        if rank == 0:
            header = Header(Op.PUSH, 0, 0, layout.job_id, num_chunks=len(spans), numel=n, dtype=1)
            if case == "bad-magic":
                wire = header.encode()
                wire[0] = 1234
                ops = [ps_wire.post_send(wire, 1, ps_wire.TAG_REQUEST)]
            elif case == "other-job":
                wire = Header(Op.PULL, 0, 0, layout.job_id ^ 1).encode()
                ops = [ps_wire.post_send(wire, 1, ps_wire.TAG_REQUEST)]
            else:
                size = n - 1 if case == "short-payload" else n + 1
                ops = [
                    ps_wire.post_send(header.encode(), 1, ps_wire.TAG_REQUEST),
                    ps_wire.post_send(torch.ones(size), 1, ps_wire.TAG_PUSH),
                ]
            ps_wire.wait_all(ops)
            continue
        initial = {name: p.detach().clone() for name, p in model.named_parameters()}
        server = ParameterServer(
            index=0,
            layout=layout,
            initial=initial,
            optim=job.optim,
            lr_at=lambda clock: 0.1,
            mode="async",
            staleness=0,
            workers=[0],
            spares=[],
            num_worker_slots=1,
            num_pushers=1,
        )
        try:
            server.serve_until_clock(1)
        except ProtocolError as exc:
            message = str(exc)
        else:
            raise AssertionError(f"{case}: the server accepted a bad message")
        unchanged = all(torch.equal(server.params[k].detach(), initial[k]) for k in initial)
        out[case] = {"message": message, "unchanged": unchanged, "updates": server.stats.updates}
    return out


def test_server_rejects_bad_messages_and_applies_nothing() -> None:
    _, server = run_distributed(_bad_message_rank, 2, timeout_s=60)
    for case, words in BAD_CASES.items():
        result = server[case]
        assert words in result["message"], (case, result["message"])
        assert "rank 0" in result["message"] and "\n" not in result["message"]
        assert result["unchanged"] and result["updates"] == 0, case


def test_hogwild_matches_serial_sgd_on_sparse_problem() -> None:
    """Two lock-free processes reach the loss of serial SGD with the same number of updates."""
    from polytrain.ps.hogwild import HogwildConfig, make_problem, run_hogwild

    base = {"features": 50_000, "examples": 10_000, "nonzeros": 16}
    serial_cfg = HogwildConfig(workers=1, steps=20_000, **base)
    data = make_problem(serial_cfg)
    serial = run_hogwild(serial_cfg, data)
    hogwild = run_hogwild(HogwildConfig(workers=2, steps=10_000, **base), data)
    assert hogwild.updates == serial.updates
    assert hogwild.loss < 0.8 * hogwild.initial_loss
    assert abs(hogwild.loss - serial.loss) < 0.02 * serial.loss, (hogwild, serial)


def _out_of_order_rank(rank: int, world_size: int) -> Any:
    """Rank 0 pushes one gradient in chunks, last chunk first; rank 1 serves (async)."""
    from polytrain.comm import ps_wire
    from polytrain.data.datasets import build_datasets
    from polytrain.models.registry import build_model
    from polytrain.ps.layout import build_layout
    from polytrain.ps.protocol import Header, Op
    from polytrain.ps.server import ParameterServer

    job = small_job()
    _, _, spec = build_datasets(job.data, 16)
    model = build_model(job.model, spec, 0)
    layout = build_layout(model, 1, 4)
    spans = layout.spans(0)
    # Distinct values everywhere, so a chunk's borrowed guard element left in place would show.
    grad = torch.arange(layout.numel(0), dtype=torch.float32) / layout.numel(0)
    if rank == 0:
        ops = []
        for k in reversed(range(len(spans))):
            start, stop = spans[k]
            header = Header(
                Op.PUSH, 0, 0, layout.job_id, chunk=k, num_chunks=len(spans),
                numel=stop - start, dtype=1,
            )  # fmt: skip
            ops.append(ps_wire.post_send(header.encode(), 1, ps_wire.TAG_REQUEST))
            ops.append(ps_wire.post_send(grad[start:stop], 1, ps_wire.TAG_PUSH))
        ops.append(
            ps_wire.post_send(
                Header(Op.CLOCK, 0, 0, layout.job_id).encode(), 1, ps_wire.TAG_REQUEST
            )
        )
        ps_wire.wait_all(ops)
        return None
    server = ParameterServer(
        index=0,
        layout=layout,
        initial={name: p.detach().clone() for name, p in model.named_parameters()},
        optim=job.optim,
        lr_at=lambda clock: 0.1,
        mode="async",
        staleness=0,
        workers=[0],
        spares=[],
        num_worker_slots=1,
        num_pushers=1,
    )
    server.serve_until_clock(1)
    return {
        "chunks": len(spans),
        "grad_equal": torch.equal(server.grad_flat, grad),
        "updates": server.stats.updates,
    }


def test_server_assembles_chunks_arriving_last_first() -> None:
    """Chunks land in place in the staging buffer (each borrowing the next chunk's first
    element as its guard), so the applied gradient is exact whatever the arrival order."""
    _, server = run_distributed(_out_of_order_rank, 2, timeout_s=300)
    assert server["chunks"] > 2
    assert server["grad_equal"] and server["updates"] == 1


def _pull_with_clock_rank(
    rank: int, world_size: int, out_dir: str, mode: str = "sync"
) -> dict[str, Any]:
    """Train a 4-step job (1 server), recording on each worker the order of its CLOCKs, its
    whole pushes, its pulls, its loss all-reduces and its step ends; the server returns its
    stats file."""
    from polytrain.ps import strategy as ps_strategy
    from polytrain.ps import worker as ps_worker
    from polytrain.trainer.loop import train

    calls: list[tuple[str, int]] = []
    client, strategy = ps_worker.WorkerClient, ps_strategy.PSStrategy
    post_clock, post_pull, init = client.post_clock, client.post_pull, strategy.__init__
    push, train_step = client.push, strategy.train_step

    def pushed(self: Any, c: int, *a: Any, **kw: Any) -> Any:
        out = push(self, c, *a, **kw)
        calls.append(("push", c))
        return out

    def stepped(self: Any, step: int) -> Any:
        out = train_step(self, step)
        calls.append(("step end", step))
        return out

    def clock(self: Any, c: int) -> None:
        calls.append(("clock", c))
        post_clock(self, c)

    def pull(self: Any, c: int) -> Any:
        calls.append(("pull", c))
        return post_pull(self, c)

    def build(self: Any, *a: Any, **kw: Any) -> None:
        init(self, *a, **kw)
        reduce = self.reduce

        def recorded(stats: torch.Tensor) -> tuple[float, bool]:
            calls.append(("reduce", self.clock - 1))
            return reduce(stats)

        self.reduce = recorded

    client.post_clock, client.post_pull, strategy.__init__ = clock, pull, build  # type: ignore[method-assign]
    client.push, strategy.train_step = pushed, stepped  # type: ignore[method-assign]
    job = small_job(
        parallel={"sync": "ps"},
        ps={"servers": 1, "mode": mode},
        launch={"nproc": world_size},
        observe={"out_dir": out_dir},
    )
    train(job)
    stats = _server_stats(out_dir, 1)[0] if rank == world_size - 1 else None
    return {"calls": calls, "stats": stats}


def test_sync_posts_clock_before_the_loss_reduce_and_pulls_before_leaving_the_step(
    tmp_path: Path,
) -> None:
    """[Note: pull with the clock]: each worker's CLOCK of step c leaves before its loss
    all-reduce and the pull of c + 1 right after it (none after the last step); [Note: transfer
    windows]: the server saw each clock's push and pull whole, the update between them."""
    out = run_distributed(_pull_with_clock_rank, 3, str(tmp_path), timeout_s=300)
    steps = 4
    for rank in (0, 1):
        calls = out[rank]["calls"]
        for c in range(steps):
            assert calls.index(("clock", c)) < calls.index(("reduce", c)), (rank, calls)
            if c + 1 < steps:
                assert calls.index(("reduce", c)) < calls.index(("pull", c + 1)), (rank, calls)
        # The last step posts no pull: the final evaluation pulls after it, on its own.
        assert calls.index(("reduce", steps - 1)) < calls.index(("pull", steps)), calls
    stats = out[2]["stats"]
    shard_bytes = stats["bytes_in"] // (2 * steps)  # 2 workers push every step
    windows = stats["windows"]
    assert sorted(windows) == [str(c) for c in range(steps + 1)]
    assert windows[str(steps)]["pull_bytes"] == 2 * shard_bytes  # the evaluation's pulls
    for c in range(steps):
        w = windows[str(c)]
        assert w["push_bytes"] == w["pull_bytes"] == 2 * shard_bytes
        assert w["push_start"] <= w["push_end"] <= w["apply_start"] <= w["apply_end"]
        assert w["pull_start"] <= w["pull_end"]
        if c > 0:  # the pull of c carries the update of c - 1
            assert windows[str(c - 1)]["apply_end"] <= w["pull_start"]
    assert stats["window_bytes_per_s"] > 0


def test_async_posts_the_next_pull_with_its_push(tmp_path: Path) -> None:
    """[Note: pull with the clock], async: a worker posts the pull of step c + 1 right after
    its whole push of step c, before step c ends (none after the last step)."""
    out = run_distributed(_pull_with_clock_rank, 3, str(tmp_path), "async", timeout_s=300)
    steps = 4
    for rank in (0, 1):
        calls = out[rank]["calls"]
        for c in range(steps):
            if c + 1 < steps:
                assert calls.index(("push", c)) < calls.index(("pull", c + 1)), (rank, calls)
                assert calls.index(("pull", c + 1)) < calls.index(("step end", c)), (rank, calls)
        assert calls.index(("step end", steps - 1)) < calls.index(("pull", steps)), calls


def _link_probe_rank(rank: int, world_size: int) -> Any:
    """Ranks 0 and 2 probe their link (rank 1 stays out); then a ps job's automatic chunk."""
    from polytrain.comm import ps_wire
    from polytrain.ps import strategy as ps_strategy

    points = ps_wire.probe_link(2, lead=True) if rank == 0 else []
    if rank == 2:
        assert ps_wire.probe_link(0, lead=False) == []
    link = ps_strategy._measured_link(rank, [2])
    return {"points": points, "link": link}


def test_the_link_is_measured_at_start_up_and_shared(tmp_path: Path) -> None:
    """[Note: chunk size from the link]: rank 0 times every probe size to the server's rank
    (a loopback round trip is far below the slow-link stop), one-way seconds growing with the
    size; every rank gets rank 0's points, so every rank cuts the same chunks."""
    from polytrain.comm.ps_wire import LINK_PROBE_BYTES

    out = run_distributed(_link_probe_rank, 3, timeout_s=300)
    sizes = [b for b, _ in out[0]["points"]]
    assert sizes == [float(b) for b in LINK_PROBE_BYTES]
    seconds = [t for _, t in out[0]["points"]]
    assert all(t > 0 for t in seconds) and seconds[-1] > seconds[0]
    assert out[1]["points"] == out[2]["points"] == []
    assert out[0]["link"] == out[1]["link"] == out[2]["link"]
    assert len(out[0]["link"]) == len(LINK_PROBE_BYTES)

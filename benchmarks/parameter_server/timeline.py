"""Where the exposed (non-compute) time of a ps sync step goes, with timestamps.

Runs ``--steps`` steps of ``--model`` (``default``: gpt tiny; ``gpt11m``) with 2 workers and
1 dedicated server (sync, ``ps.overlap`` on), recording `time.perf_counter` (one monotonic clock
for every process of the host) at each phase of both workers' steps (wrapping `PSStrategy`
and `WorkerClient` methods) and reading the server's `TransferWindow`s ([Note: transfer windows]
in polytrain.ps.stats) plus the arrival of every CLOCK and PULL. Prints, per step after the
first, the phases of worker 0 and the server as milliseconds from worker 0's step start, then
the mean of each phase over those steps.

A worker step is: grant (PULL sent -> every server's ACK), forward + backward (with the waits
of the forward pre-hooks for pulled chunks, `ParamFetcher.wait_s`), finish (the NaN flag and
the loss all-reduce between the workers), push end (CLOCK to every server, wait for every
chunk send). Exposed = step time - (forward + backward - chunk waits), the denominator of
speed.py's server throughput.

Run: PYTHONPATH=src python benchmarks/parameter_server/timeline.py [--model default] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODELS: dict[str, dict[str, Any]] = {
    "default": {"name": "gpt", "size": "tiny"},
    "gpt11m": {"name": "gpt", "n_embd": 384, "n_layer": 6, "n_head": 6},
}


def _job(model: str, steps: int, out_dir: str, chunk_kb: int) -> Any:
    from polytrain.config import job_from_dict

    return job_from_dict(
        {
            "model": dict(MODELS[model]),
            "train": {"steps": steps, "seed": 0, "eval_every": 0, "sample_tokens": 0},
            "observe": {"progress": False, "out_dir": out_dir, "log_every": 1000},
            "launch": {"nproc": 3},
            "parallel": {"sync": "ps"},
            "ps": {"servers": 1, "mode": "sync", "chunk_kb": chunk_kb},
        }
    )


def _instrument(events: list[tuple[str, int, float]]) -> None:
    """Wrap the worker's and server's phases so each appends (name, step, perf_counter)."""
    from polytrain.ps import server as ps_server
    from polytrain.ps import strategy as ps_strategy
    from polytrain.ps import worker as ps_worker

    def mark(name: str, step: int) -> None:
        events.append((name, step, time.perf_counter()))

    strategy_cls = ps_strategy.PSStrategy
    client_cls = ps_worker.WorkerClient

    def wrap(cls: Any, attr: str, name: str, clock_arg: bool = True) -> None:
        """``cls.attr`` marks ``name_start`` and ``name_end`` (step: its first argument, or
        -1 when ``clock_arg`` is False: the running step)."""
        inner = getattr(cls, attr, None)
        if inner is None:  # an older worker without this phase
            return

        def timed(self: Any, *a: Any, **kw: Any) -> Any:
            step = a[0] if clock_arg and a else -1
            mark(f"{name}_start", step)
            out = inner(self, *a, **kw)
            mark(f"{name}_end", step)
            return out

        setattr(cls, attr, timed)

    wrap(strategy_cls, "train_step", "step")
    wrap(strategy_cls, "_forward_backward", "fb")
    wrap(strategy_cls, "_post_clock", "post_clock")
    wrap(strategy_cls, "_push", "push")
    wrap(client_cls, "post_pull", "post_pull", clock_arg=False)
    wrap(client_cls, "post_clock", "clock_sent")
    wrap(client_cls, "end_push", "end_push")  # the CLOCK before [Note: pull with the clock]
    wrap(client_cls, "wait_chunks", "push_wait", clock_arg=False)
    wrap(client_cls, "begin_pull", "grant_wait", clock_arg=False)
    wrap(getattr(ps_worker, "PostedPull", None), "granted", "grant_wait", clock_arg=False)
    wrap(ps_worker.PendingPull, "wait_rest", "rest_wait", clock_arg=False)
    post_chunk, wait_chunk = client_cls.post_chunk, ps_worker.PendingPull.wait_chunk
    init, fwd_bwd = strategy_cls.__init__, strategy_cls._forward_backward
    handle = ps_server.ParameterServer._handle

    def s_init(self: Any, *a: Any, **kw: Any) -> None:
        init(self, *a, **kw)
        reduce = self.reduce

        def timed_reduce(stats: Any) -> Any:
            mark("reduce_start", self.clock - 1)
            out = reduce(stats)
            mark("reduce_end", self.clock - 1)
            return out

        self.reduce = timed_reduce

    def s_fwd_bwd(self: Any, step: int) -> Any:
        out = fwd_bwd(self, step)
        if self.fetcher is not None:
            events.append(("chunk_wait_s", step, self.fetcher.wait_s))
        return out

    def c_post_chunk(self: Any, clock: int, *a: Any) -> None:
        mark("chunk_posted", clock)
        post_chunk(self, clock, *a)

    def p_wait_chunk(self: Any, s: int, k: int) -> Any:
        out = wait_chunk(self, s, k)
        events.append((f"chunk_in:{s}:{k}", -1, time.perf_counter()))
        return out

    def v_handle(self: Any, header: Any, payload: Any, when: Any = (0, 0)) -> None:
        op = header.op.name
        if op in ("CLOCK", "PULL"):
            events.append((f"srv_{op.lower()}_in:{header.worker}", header.clock, when[0]))
        handle(self, header, payload, when)

    strategy_cls.__init__ = s_init  # type: ignore[method-assign]
    strategy_cls._forward_backward = s_fwd_bwd  # type: ignore[method-assign]
    client_cls.post_chunk = c_post_chunk  # type: ignore[method-assign]
    ps_worker.PendingPull.wait_chunk = p_wait_chunk  # type: ignore[method-assign]
    ps_server.ParameterServer._handle = v_handle  # type: ignore[method-assign]


def _rank(rank: int, world: int, model: str, steps: int, chunk_kb: int) -> dict[str, Any]:
    from polytrain.trainer.loop import train

    events: list[tuple[str, int, float]] = []
    _instrument(events)
    with tempfile.TemporaryDirectory(prefix="ps-timeline-") as out_dir:
        result = train(_job(model, steps, out_dir, chunk_kb))
        stats_path = Path(out_dir) / "ps" / "server0.json"
        server = json.loads(stats_path.read_text()) if rank == world - 1 else None
    # Chunk arrivals carry no step: give them the step that was running.
    step = -1
    tagged: list[tuple[str, int, float]] = []
    for name, s, t in events:
        if name == "step_start":
            step = s
        tagged.append((name, step if s == -1 else s, t))
    return {
        "events": tagged,
        "server": server,
        "step_times": [r["step_time_s"] for r in result.history],
    }


def _first(events: list[tuple[str, int, float]], name: str, step: int) -> float:
    return min((t for n, s, t in events if n == name and s == step), default=float("nan"))


def _last(events: list[tuple[str, int, float]], name: str, step: int) -> float:
    return max((t for n, s, t in events if n == name and s == step), default=float("nan"))


def _phases(workers: list[list[Any]], server: dict[str, Any], step: int) -> dict[str, float]:
    """Milliseconds from worker 0's step start, for one step."""
    ev0 = workers[0]
    t0 = _first(ev0, "step_start", step)
    ms = {}

    def at(name: str, t: float) -> None:
        ms[name] = (t - t0) * 1e3

    for w, ev in enumerate(workers):
        for name, label in (
            ("step_start", "step start"),
            ("grant_wait_start", "waits for the grant (ACK)"),
            ("grant_wait_end", "grant in"),
            ("fb_start", "fwd+bwd start"),
            ("fb_end", "fwd+bwd end"),
            ("post_clock_start", "NaN check + CLOCK: start"),
            ("clock_sent_start", "CLOCK posted"),
            ("end_push_start", "CLOCK posted (before: with the push end)"),
            ("post_pull_end", "next PULL posted"),
            ("reduce_start", "loss all-reduce start"),
            ("reduce_end", "loss all-reduce end"),
            ("push_wait_end", "push sends done"),
            ("step_end", "step end"),
        ):
            at(f"w{w} {label}", _first(ev, name, step))
        chunks = [t for n, s, t in ev if n.startswith("chunk_in") and s == step]
        if chunks:
            at(f"w{w} first chunk in", min(chunks))
            at(f"w{w} last chunk in", max(chunks))
        at(f"w{w} first push chunk posted", _first(ev, "chunk_posted", step))
        at(f"w{w} last push chunk posted", _last(ev, "chunk_posted", step))
        at(f"w{w} previous step end", _first(ev, "step_end", step - 1))
        ms[f"w{w} chunk waits in forward"] = _first(ev, "chunk_wait_s", step) * 1e3
        fb = _first(ev, "fb_end", step) - _first(ev, "fb_start", step)
        ms[f"w{w} compute (fwd+bwd - waits)"] = fb * 1e3 - ms[f"w{w} chunk waits in forward"]
        step_s = _first(ev, "step_end", step) - _first(ev, "step_start", step)
        ms[f"w{w} exposed (step - compute)"] = step_s * 1e3 - ms[f"w{w} compute (fwd+bwd - waits)"]
    srv = server["events"]
    for w in range(len(workers)):
        at(f"srv PULL in from w{w}", _first(srv, f"srv_pull_in:{w}", step))
        at(f"srv CLOCK in from w{w}", _first(srv, f"srv_clock_in:{w}", step))
    win = server["windows"]
    for clock, which in ((step - 1, "previous"), (step, "this"), (step + 1, "next")):
        for key in ("push_start", "push_end", "apply_start", "apply_end", "pull_start", "pull_end"):
            value = win.get(str(clock), {}).get(key)
            if value is not None:
                at(f"srv {which} clock {key}", value)
    return ms


def _summary(table: dict[int, dict[str, float]], steps: range) -> dict[str, float]:
    """Durations per step (medians): where each worker's exposed time goes, and the server."""

    def med(fn: Any) -> float:
        values = [fn(table[s]) for s in steps]
        values = [v for v in values if v == v]
        return statistics.median(values) if values else float("nan")

    out: dict[str, float] = {}
    for w in (0, 1):
        p = f"w{w} "
        out[p + "exposed: step - (fwd+bwd - chunk waits)"] = med(
            lambda r, p=p: r[p + "exposed (step - compute)"]
        )
        out[p + "  grant wait: step start -> grant in"] = med(
            lambda r, p=p: r[p + "grant in"] - r[p + "step start"]
        )
        out[p + "  step start -> first chunk in (forward can start)"] = med(
            lambda r, p=p: r[p + "first chunk in"] - r[p + "step start"]
        )
        out[p + "  chunk waits in forward"] = med(lambda r, p=p: r[p + "chunk waits in forward"])
        out[p + "  fwd+bwd end -> loss all-reduce start (NaN flag, CLOCK)"] = med(
            lambda r, p=p: r[p + "loss all-reduce start"] - r[p + "fwd+bwd end"]
        )
        out[p + "  loss all-reduce (incl. waiting for the other worker)"] = med(
            lambda r, p=p: r[p + "loss all-reduce end"] - r[p + "loss all-reduce start"]
        )
        out[p + "  loss all-reduce end -> step end (pull posted, push sends)"] = med(
            lambda r, p=p: r[p + "step end"] - r[p + "loss all-reduce end"]
        )
        out[p + "between steps (loop)"] = med(
            lambda r, p=p: r[p + "step start"] - r[p + "previous step end"]
        )
    out["slower worker's fwd+bwd end -> server's last CLOCK in"] = med(
        lambda r: (
            max(r["srv CLOCK in from w0"], r["srv CLOCK in from w1"])
            - max(r["w0 fwd+bwd end"], r["w1 fwd+bwd end"])
        )
    )
    out["server: last CLOCK in -> update start"] = med(
        lambda r: (
            r["srv this clock apply_start"]
            - max(r["srv CLOCK in from w0"], r["srv CLOCK in from w1"])
        )
    )
    out["server: update (sum, clip, AdamW)"] = med(
        lambda r: r["srv this clock apply_end"] - r["srv this clock apply_start"]
    )
    out["server: update end -> next pull's first reply posted"] = med(
        lambda r: r["srv next clock pull_start"] - r["srv this clock apply_end"]
    )
    out["server: pull window (both workers' replies)"] = med(
        lambda r: r["srv this clock pull_end"] - r["srv this clock pull_start"]
    )
    out["server: push window (first chunk in -> last in)"] = med(
        lambda r: r["srv this clock push_end"] - r["srv this clock push_start"]
    )
    out["server: update end -> worker 0's next step start"] = med(
        lambda r: -r["srv previous clock apply_end"]
    )
    return out


def main() -> None:
    from polytrain.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="default")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--chunk-kb", type=int, default=0)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    results = run_distributed(_rank, 3, args.model, args.steps, args.chunk_kb, timeout_s=1800)
    workers = [results[0]["events"], results[1]["events"]]
    server = dict(results[2]["server"])
    server["events"] = results[2]["events"]
    steps = range(1, args.steps - 1)  # skip the warm-up step and the last (no next pull)
    table = {step: _phases(workers, server, step) for step in steps}
    names = [n for n in table[steps[0]] if any(table[s][n] == table[s][n] for s in steps)]
    print(f"step times (worker 0): {[round(t, 4) for t in results[0]['step_times']]}")
    head = "".join(f"{s:>8d}" for s in steps)
    print(f"{'phase (ms from w0 step start)':44s}{head}  median")
    for name in sorted(names, key=lambda n: statistics.median(table[s][n] for s in steps)):
        row = [table[s][name] for s in steps]
        print(f"{name:44s}" + "".join(f"{v:8.1f}" for v in row) + f"{statistics.median(row):8.1f}")
    print("summary (medians over the steps above, ms):")
    for label, value in _summary(table, steps).items():
        print(f"  {label:70s}{value:8.1f}")
    rate = server.get("window_bytes_per_s")
    print(f"server bytes / transfer-window time: {rate / 1e6 if rate else float('nan'):.0f} MB/s")
    if args.out:
        Path(args.out).write_text(json.dumps({"table": table, "server": server}, indent=1))


if __name__ == "__main__":
    main()

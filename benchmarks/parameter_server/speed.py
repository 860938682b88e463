"""Parameter-server sync at wire speed: step time against data parallel, and link use.

Question: for the default job (gpt tiny) and an 11M-parameter GPT (n_embd 384, 6 layers, 6
heads), both with 2 workers, how does a ps sync step (1 dedicated server) compare with a data
parallel step (DDP all-reduce) in the same script, and what fraction of the raw c10d
point-to-point bandwidth, measured in the same processes, does the server's traffic reach?

Runs, interleaved ABBA per model so that a load change hits both peers alike: ps, dp, dp, ps.
Step time = median of the steps after the first (warm-up). In each ps run, before training,
rank 0 sends ``--bw-mb`` MiB to the server rank in chunks of the job's (automatic) chunk size
with the same `comm/ps_wire` calls: the raw bandwidth. Two server throughputs, both reported
as fractions of that raw bandwidth:

- ``fraction_of_raw`` (the issue's metric): the bytes through the server per step (2 workers x
  (push + pull) x model bytes) over the step's communication time, ps step time minus the
  slower worker's own forward + backward time in that step (each step paired with its own
  compute, median over steps; until 2026-11-25 evening a median step minus a median compute),
  timed in the run. A synchronous step cannot end before its slower worker has computed; everything else
  counts as transfer time: the server's sum, clipping and optimizer step, the loss all-reduce,
  the waits for chunks. ``fraction_of_raw_w0`` is the same over worker 0's compute alone (the
  figure reported until 2026-11-25), which also counts the two workers' compute imbalance on
  the shared cores (10-20% of a step's compute on the 2-core VM) as transfer time.
- ``window_fraction_of_raw``: the bytes the server received and sent over the time inside its
  own transfer windows ([Note: transfer windows] in polytrain.ps.stats, from `ServerStats`):
  per step, from the header of the first pushed chunk to the last chunk in, plus from the first
  reply of the pull posted to the last one sent, summed over the steps after the first. It is
  the server's rate while it moves data; with ``ps.overlap`` a push window also holds the rest
  of the workers' backward after their first chunk left, so ``pull_window_fraction_of_raw``
  (the pull windows alone: the server's bytes sent over the time it was sending them) is
  reported too.

With ``ps.overlap`` (the default) the worker's forward waits for pulled chunks inside its
pre-hooks; that wait is counted as communication, not compute. ``--compare-overlap`` adds ps
runs with ``ps.overlap = false`` (ABBA: off, on, on, off) and reports on / off.

``--sweep`` adds ps runs at fixed chunk sizes (``--sweep-kb``) beside the automatic one, to
check that the default is within 10% of the best fixed chunk size.

``--slow-mbit R`` adds the same ABBA comparison (ps, dp, dp, ps) for ``--slow-models`` with
every rank on its own emulated host (`polytrain.testing.cluster`: network namespaces joined by
veth pairs, each host's link tbf-limited to R Mbit/s; needs root): ps runs 3 hosts (2 workers +
1 dedicated server), dp 2, and colocated ps (``ps.colocate``: 2 hosts, each a worker and the
server of half the shards, BytePS's colocated mode) 2; ABBA: colocated, ps, dp, dp, ps,
colocated. ``--colocated`` adds two colocated runs on loopback too.

Run: PYTHONPATH=src python benchmarks/parameter_server/speed.py [--steps 12] [--sweep]
     [--compare-overlap] [--colocated] [--slow-mbit 200]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODELS: dict[str, dict[str, Any]] = {
    "default": {"name": "gpt", "size": "tiny"},
    "gpt11m": {"name": "gpt", "n_embd": 384, "n_layer": 6, "n_head": 6},
}


def _world(sync: str) -> int:
    """ps: 2 workers + 1 dedicated server; colocated (2 ranks that also serve) and dp: 2."""
    return 3 if sync == "ps" else 2


def _job(
    model: str, sync: str, steps: int, chunk_kb: int, out_dir: str, overlap: bool = True
) -> Any:
    from polytrain.config import job_from_dict

    data: dict[str, Any] = {
        "model": dict(MODELS[model]),
        "train": {"steps": steps, "seed": 0, "eval_every": 0, "sample_tokens": 0},
        "observe": {"progress": False, "out_dir": out_dir, "log_every": 1000},
        "launch": {"nproc": _world(sync)},
    }
    if sync == "ps":
        data["parallel"] = {"sync": "ps"}
        data["ps"] = {"servers": 1, "mode": "sync", "chunk_kb": chunk_kb, "overlap": overlap}
    elif sync == "colocated":  # both ranks work and serve one shard each
        data["parallel"] = {"sync": "ps"}
        data["ps"] = {"servers": 2, "colocate": True, "chunk_kb": chunk_kb, "overlap": overlap}
    return job_from_dict(data)


def _bandwidth(rank: int, world: int, megabytes: int, chunk_elems: int) -> float | None:
    """Raw chunked isend bandwidth rank 0 -> last rank (bytes/s), best of 3 rounds."""
    import torch

    from polytrain.comm import ps_wire

    server = world - 1
    if rank not in (0, server):
        return None
    chunks = max(1, megabytes * (1 << 20) // (chunk_elems * 4))
    buf = torch.ones(chunk_elems)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        if rank == 0:
            ops = [ps_wire.post_send(buf, server, ps_wire.TAG_PROBE + 1) for _ in range(chunks)]
        else:
            ops = [
                ps_wire.post_recv(torch.empty(chunk_elems), 0, ps_wire.TAG_PROBE + 1)
                for _ in range(chunks)
            ]
        ps_wire.wait_all(ops)
        best = min(best, time.perf_counter() - start)
    return chunks * chunk_elems * 4 / best


def _rank(
    rank: int,
    world: int,
    model: str,
    sync: str,
    steps: int,
    chunk_kb: int,
    bw_mb: int,
    overlap: bool,
) -> dict[str, Any]:
    from polytrain.ps import strategy as ps_strategy
    from polytrain.trainer.loop import train

    compute: list[float] = []
    measured: dict[str, Any] = {"bandwidth": None, "numel": 0}
    if sync == "ps":
        init = ps_strategy.PSStrategy.__init__
        inner = ps_strategy.PSStrategy._forward_backward

        def init_then_measure(self: Any, *a: Any, **kw: Any) -> None:
            init(self, *a, **kw)
            # Once every rank built its strategy: rank 0 and the server time the raw link in
            # the job's own chunk size (a tag nobody else uses; the server's receiver threads
            # wait on their own tags meanwhile).
            measured["numel"] = sum(self.layout.numel(s) for s in range(len(self.servers)))
            measured["bandwidth"] = _bandwidth(rank, world, bw_mb, self.layout.chunk_elems)
            measured["chunk_bytes"] = self.layout.chunk_elems * 4

        def timed(self: Any, step: int) -> Any:
            # Compute only: with ps.overlap the forward pre-hooks wait for pulled chunks
            # inside forward; that wait is communication (`ParamFetcher.wait_s`).
            t0 = time.perf_counter()
            out = inner(self, step)
            waited = self.fetcher.wait_s if self.fetcher is not None else 0.0
            compute.append(time.perf_counter() - t0 - waited)
            return out

        ps_strategy.PSStrategy.__init__ = init_then_measure  # type: ignore[method-assign]
        ps_strategy.PSStrategy._forward_backward = timed  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory(prefix="ps-speed-") as out_dir:
        result = train(_job(model, sync, steps, chunk_kb, out_dir, overlap))
        window_rate = server_window_rate(out_dir) if sync == "ps" and rank == world - 1 else None
    times = [r["step_time_s"] for r in result.history][1:]
    return {
        "step_s": statistics.median(times) if times else float("nan"),
        "step_steps": times,
        "compute_s": statistics.median(compute[1:]) if len(compute) > 1 else None,
        "compute_steps": compute[1:],
        "bandwidth": measured["bandwidth"],
        "numel": measured["numel"],
        "chunk_bytes": measured.get("chunk_bytes"),
        "window": window_rate,
    }


def server_window_rate(out_dir: str) -> dict[str, float] | None:
    """The server's bytes over its transfer windows, over all of them and over the pull
    windows alone (``window_bytes_per_s``, ``pull_window_bytes_per_s`` of
    ``<out_dir>/ps/server0.json``, [Note: transfer windows]); None without them."""
    path = Path(out_dir) / "ps" / "server0.json"
    if not path.exists():
        return None
    stats = json.loads(path.read_text())
    if "window_bytes_per_s" not in stats:
        return None
    keys = ("window_bytes_per_s", "pull_window_bytes_per_s")
    return {k: float(stats.get(k, math.nan)) for k in keys}


def slower_compute_s(workers: list[list[float]]) -> float:
    """Median over steps of the slower worker's compute in each step (``workers``: each
    worker's per-step compute seconds, the same steps in the same order)."""
    return statistics.median(max(step) for step in zip(*workers, strict=False))


def exposed_s(step_s: list[float], workers: list[list[float]]) -> float:
    """Median over steps of (that step's time - the slower worker's compute in that step):
    the step's communication time, each step paired with its own compute (a median of step
    times minus a median of compute times mixes steps, and swung 2x between runs)."""
    per_step = zip(step_s, *workers, strict=False)
    return statistics.median(step - max(compute) for step, *compute in per_step)


def _server_throughput(
    result: dict[str, Any], window: dict[str, float] | None, workers: list[list[float]]
) -> dict[str, Any]:
    """Both server throughputs (module docstring) and each as a fraction of the raw p2p
    bandwidth measured in the same run: ``fraction_of_raw`` over the step's communication
    time, ``window_fraction_of_raw`` over the server's own transfer windows. ``workers``:
    every worker's per-step compute seconds."""
    server_bytes = 2 * 2 * result["numel"] * 4  # 2 workers x (push + pull) x fp32
    compute = slower_compute_s(workers)
    comm = max(exposed_s(result["step_steps"], workers), 1e-9)
    comm_w0 = max(result["step_s"] - result["compute_s"], 1e-9)
    raw = result["bandwidth"]
    return {
        "chunk_bytes": result["chunk_bytes"],
        "compute_s": compute,
        "compute_s_w0": result["compute_s"],
        "raw_bytes_per_s": raw,
        "server_bytes_per_s": server_bytes / comm,
        "fraction_of_raw": server_bytes / comm / raw,
        "fraction_of_raw_w0": server_bytes / comm_w0 / raw,
        "window_bytes_per_s": window["window_bytes_per_s"] if window else None,
        "window_fraction_of_raw": window["window_bytes_per_s"] / raw if window else None,
        "pull_window_fraction_of_raw": window["pull_window_bytes_per_s"] / raw if window else None,
    }


def _run(
    model: str, sync: str, args: argparse.Namespace, chunk_kb: int = 0, overlap: bool = True
) -> dict[str, Any]:
    from polytrain.testing import run_distributed

    world = _world(sync)
    results = run_distributed(
        _rank, world, model, sync, args.steps, chunk_kb, args.bw_mb, overlap, timeout_s=3000
    )
    run: dict[str, Any] = {"step_s": results[0]["step_s"], "load": os.getloadavg()[0]}
    if sync == "ps":
        run["overlap"] = overlap
        workers = [r["compute_steps"] for r in results[:-1]]
        run.update(_server_throughput(results[0], results[-1]["window"], workers))
    print(f"{model} {sync} chunk_kb={chunk_kb}: {json.dumps(run)}", flush=True)
    return run


# ------------------------------------------------------------------ emulated slow link
SLOW_PORT = 29640


def _node(spec_path: str) -> None:
    """One rank on an emulated host: join the job's process group over the shaped link, run
    `_rank`, rank 0 writes the result."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    args = (spec["model"], spec["sync"], spec["steps"], 0, spec["bw_mb"], spec["overlap"])
    result = _rank(rank, world, *args)
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(result))
    if spec["sync"] == "ps" and rank < world - 1:  # every worker's per-step compute
        Path(f"{spec['out']}.w{rank}").write_text(json.dumps(result["compute_steps"]))
    if rank == world - 1 and spec["sync"] == "ps":  # the server's transfer-window rate
        Path(spec["out"] + ".server").write_text(json.dumps(result["window"]))
    dist.destroy_process_group()


def _run_slow(model: str, sync: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run with every rank on its own emulated host, each host's link shaped to
    ``--slow-mbit`` (tbf on veth between network namespaces: `polytrain.testing.cluster`)."""
    from polytrain.testing.cluster import Cluster, LinkSpec

    world = _world(sync)
    link = LinkSpec(rate_mbit=args.slow_mbit)
    with tempfile.TemporaryDirectory() as tmp, Cluster(world, link=link) as cluster:
        out, spec_path = Path(tmp) / "result.json", Path(tmp) / "spec.json"
        spec = {"model": model, "sync": sync, "steps": args.steps, "out": str(out)}
        spec.update(bw_mb=max(1, args.bw_mb // 8), overlap=True)
        spec_path.write_text(json.dumps(spec))
        cluster.run_ranks(
            range(world),  # one rank per host
            [sys.executable, str(Path(__file__).resolve()), "_node", str(spec_path)],
            port=SLOW_PORT,
            pythonpath=os.pathsep.join([str(HERE.parents[1] / "src"), str(HERE.parents[1])]),
            timeout_s=1800,
            what=f"a {sync} rank",
        )
        result = json.loads(out.read_text())
        server_out = Path(str(out) + ".server")
        window = json.loads(server_out.read_text()) if server_out.exists() else None
        workers = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("result.json.w*"))]
    run: dict[str, Any] = {"step_s": result["step_s"], "load": os.getloadavg()[0]}
    if sync == "ps":
        run.update(_server_throughput(result, window, workers))
    print(f"{model} {sync} over {args.slow_mbit:g} Mbit/s: {json.dumps(run)}", flush=True)
    return run


def _slow_entry(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """ABBA over the shaped link: colocated ps (2 hosts), ps with a dedicated server (3
    hosts), dp (2 hosts): colocated, ps, dp, dp, ps, colocated."""
    colo = [_run_slow(model, "colocated", args)]
    ps = [_run_slow(model, "ps", args)]
    dp = [_run_slow(model, "dp", args), _run_slow(model, "dp", args)]
    ps.append(_run_slow(model, "ps", args))
    colo.append(_run_slow(model, "colocated", args))
    dp_s = statistics.mean(r["step_s"] for r in dp)
    return {
        "rate_mbit": args.slow_mbit,
        "colocated": colo,
        "ps": ps,
        "dp": dp,
        "colocated_over_dp": statistics.mean(r["step_s"] for r in colo) / dp_s,
        "ps_over_dp": statistics.mean(r["step_s"] for r in ps) / dp_s,
        "fraction_of_raw": statistics.mean(r["fraction_of_raw"] for r in ps),
        "fraction_of_raw_w0": _mean_of(ps, "fraction_of_raw_w0"),
        "window_fraction_of_raw": _mean_of(ps, "window_fraction_of_raw"),
        "pull_window_fraction_of_raw": _mean_of(ps, "pull_window_fraction_of_raw"),
    }


def _throughputs(entry: dict[str, Any]) -> str:
    """The three server-throughput fractions of raw p2p, labelled (module docstring)."""

    def fmt(key: str) -> str:
        value = entry.get(key)
        return "n/a" if value is None else f"{value:.2f}"

    return (
        f"{fmt('fraction_of_raw')} over the step's communication time (issue 14's metric; "
        f"{fmt('fraction_of_raw_w0')} over worker 0's compute alone), "
        f"{fmt('window_fraction_of_raw')} over the server's transfer windows (push + pull), "
        f"{fmt('pull_window_fraction_of_raw')} over its pull windows"
    )


def _mean_of(runs: list[dict[str, Any]], key: str) -> float | None:
    """Mean of ``key`` over ``runs``; None if a run lacks it (a server without windows)."""
    values = [r.get(key) for r in runs]
    return statistics.mean(v for v in values if v is not None) if None not in values else None


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "_node":  # a rank on an emulated host
        _node(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="default,gpt11m", help="'' = only the slow link")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--bw-mb", type=int, default=64)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-kb", default="256,1024,4096")
    parser.add_argument(
        "--slow-mbit",
        type=float,
        default=0.0,
        help="also run ps and dp with every rank on its own emulated host (network namespaces, "
        "needs root) whose link is tbf-limited to this many Mbit/s; 0 = skip",
    )
    parser.add_argument("--slow-models", default="default")
    parser.add_argument(
        "--colocated",
        action="store_true",
        help="add loopback runs with ps.colocate (2 ranks, each a worker and a server)",
    )
    parser.add_argument(
        "--compare-overlap",
        action="store_true",
        help="add ps runs with ps.overlap = false (push after backward, whole pulls)",
    )
    parser.add_argument("--out", default=str(HERE / "speed_results.json"))
    args = parser.parse_args()
    report: dict[str, Any] = {}
    for model in [m for m in args.models.split(",") if m]:
        ps = [_run(model, "ps", args)]
        dp = [_run(model, "dp", args), _run(model, "dp", args)]
        ps.append(_run(model, "ps", args))
        entry: dict[str, Any] = {"ps": ps, "dp": dp}
        entry["ps_over_dp"] = statistics.mean(r["step_s"] for r in ps) / statistics.mean(
            r["step_s"] for r in dp
        )
        # Both throughputs, side by side (module docstring): over the step's communication
        # time (the metric) and over the server's own transfer windows.
        entry["fraction_of_raw"] = statistics.mean(r["fraction_of_raw"] for r in ps)
        entry["fraction_of_raw_w0"] = _mean_of(ps, "fraction_of_raw_w0")
        entry["window_fraction_of_raw"] = _mean_of(ps, "window_fraction_of_raw")
        entry["pull_window_fraction_of_raw"] = _mean_of(ps, "pull_window_fraction_of_raw")
        if args.colocated:  # ABBA against the dp runs' neighbours: colocated, colocated
            colo = [_run(model, "colocated", args), _run(model, "colocated", args)]
            entry["colocated"] = colo
            entry["colocated_over_dp"] = statistics.mean(
                r["step_s"] for r in colo
            ) / statistics.mean(r["step_s"] for r in dp)
        if args.compare_overlap:  # ABBA again: off, on, on, off
            off = [_run(model, "ps", args, overlap=False)]
            on = [_run(model, "ps", args), _run(model, "ps", args)]
            off.append(_run(model, "ps", args, overlap=False))
            entry["ps_no_overlap"] = off
            entry["overlap_over_no_overlap"] = statistics.mean(
                r["step_s"] for r in on
            ) / statistics.mean(r["step_s"] for r in off)
        if args.sweep:
            sizes = [int(kb) for kb in args.sweep_kb.split(",")]
            # ABBA over the sweep: auto, fixed..., fixed reversed..., auto.
            order = [0, *sizes, *reversed(sizes), 0]
            sweep: dict[int, list[float]] = {}
            for kb in order:
                sweep.setdefault(kb, []).append(_run(model, "ps", args, kb)["step_s"])
            means = {kb: statistics.mean(v) for kb, v in sweep.items()}
            best = min(means[kb] for kb in sizes)
            entry["sweep_step_s"] = {str(kb or "auto"): means[kb] for kb in means}
            entry["auto_over_best_fixed"] = means[0] / best
        report[model] = entry
        print(
            f"== {model}: "
            + json.dumps(
                {
                    k: v
                    for k, v in entry.items()
                    if k not in ("ps", "dp", "ps_no_overlap", "colocated")
                }
            )
        )
        print(f"== {model}: server throughput / raw p2p: {_throughputs(entry)}")
    if args.slow_mbit > 0:
        for model in args.slow_models.split(","):
            entry = _slow_entry(model, args)
            report.setdefault(model, {})["slow_link"] = entry
            print(
                f"== {model} over {args.slow_mbit:g} Mbit/s: colocated ps / dp = "
                f"{entry['colocated_over_dp']:.3f}, dedicated ps / dp = "
                f"{entry['ps_over_dp']:.3f}, server throughput / raw p2p: {_throughputs(entry)}"
            )
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

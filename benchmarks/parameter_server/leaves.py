"""Leaf servers against a flat parameter server and per-host all-reduce + push, over slow links.

Question: on emulated hosts whose links to the switch are slow (``--mbit``, default 200 Mbit/s),
how do the step time and the root server's bytes per step compare for

- ``flat``: every worker pushes to and pulls from the root server (`ps.mode = "sync"`);
- ``allreduce-push``: today's ``ps.hierarchical``: each host all-reduces, its leader pushes and
  pulls, then broadcasts in the host;
- ``leaves``: ``ps.leaves = "host"``: one leaf server per host ([Note: leaf servers] in
  polytrain.ps.leaf);

and, with ``--async``, how long do sync and async leaves take to reach a target validation loss?

Layout: ``--hosts`` worker hosts (default 4) of ``--per-host`` workers (default 2) and one more
host for the root server (rank ``hosts x per_host``), each host a network namespace whose link
is tbf-limited to ``--mbit`` both ways (`polytrain.testing.cluster`; needs root). Ranks on one
host talk over that host's loopback, unshaped. Runs interleaved ABBA (flat, allreduce-push,
leaves, leaves, allreduce-push, flat) so a load change hits every peer alike. Step time: the
median of rank 0's steps after the first; root bytes: the median over clocks of the root's
pushed-in plus pulled-out bytes (its transfer windows, `polytrain.ps.stats`).

Run (root): PYTHONPATH=src python benchmarks/parameter_server/leaves.py [--steps 8] [--mbit 200]
    [--async] [--out benchmarks/parameter_server/leaves_results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODEL = {"name": "gpt", "size": "tiny"}  # the default job's model: 0.8M parameters, 3.3 MB
KINDS = ("flat", "allreduce-push", "leaves")
PORT = 29660


def _job(kind: str, spec: dict[str, Any], out_dir: str) -> Any:
    from polytrain.config import job_from_dict

    workers = spec["hosts"] * spec["per_host"]
    ps: dict[str, Any] = {"servers": 1, "mode": spec["mode"], "ranks_per_host": spec["per_host"]}
    if kind == "allreduce-push":
        ps["hierarchical"] = True
    elif kind == "leaves":
        ps["leaves"] = "host"
    train = {"steps": spec["steps"], "seed": 0, "sample_tokens": 0, "eval_every": 0}
    train["global_batch_size"] = workers * spec["per_worker"]
    if spec.get("eval_every"):
        train.update(eval_every=spec["eval_every"], eval_batches=2)
    return job_from_dict(
        {
            "model": dict(MODEL),
            "parallel": {"sync": "ps"},
            "ps": ps,
            "train": train,
            "optim": {"lr": spec["lr"]},
            "observe": {"progress": False, "out_dir": out_dir, "log_every": 1},
            "launch": {"nproc": workers + 1, "timeout_s": 600},
        }
    )


def _node(spec_path: str) -> None:
    """One rank on its emulated host: join the group over the shaped links, train, rank 0
    writes its history."""
    import torch
    import torch.distributed as dist

    from polytrain.trainer.loop import train

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo")
    result = train(_job(spec["kind"], spec, spec["out_dir"]))
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(result.history))
    dist.destroy_process_group()


def _root_bytes(out_dir: str) -> float:
    """Median over clocks (the first skipped) of the root's push-in + pull-out bytes."""
    stats = json.loads((Path(out_dir) / "ps" / "server0.json").read_text())
    windows = [w for c, w in sorted(stats["windows"].items(), key=lambda kv: int(kv[0]))]
    per_clock = [w.get("push_bytes", 0.0) + w.get("pull_bytes", 0.0) for w in windows[1:]]
    return statistics.median(per_clock) if per_clock else float("nan")


def run(kind: str, args: argparse.Namespace, mode: str = "sync") -> dict[str, Any]:
    from polytrain.testing.cluster import Cluster, LinkSpec

    hosts, per_host = args.hosts, args.per_host
    world = hosts * per_host + 1
    with tempfile.TemporaryDirectory() as tmp, Cluster(hosts + 1, link=LinkSpec(args.mbit)) as c:
        spec = {
            "kind": kind,
            "mode": mode,
            "hosts": hosts,
            "per_host": per_host,
            "per_worker": args.per_worker,
            "steps": args.steps,
            "lr": args.lr,
            "eval_every": args.eval_every,
            "out": str(Path(tmp) / "history.json"),
            "out_dir": str(Path(tmp) / "run"),
        }
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        c.run_ranks(
            [min(rank // per_host, hosts) for rank in range(world)],  # the root: the last host
            [sys.executable, str(Path(__file__).resolve()), "_node", str(spec_path)],
            port=PORT,
            pythonpath=os.pathsep.join([str(HERE.parents[1] / "src"), str(HERE.parents[1])]),
            timeout_s=3600,
            what=f"a {kind} rank",
        )
        history = json.loads(Path(spec["out"]).read_text())
        root = _root_bytes(spec["out_dir"])
    times = [r["step_time_s"] for r in history][1:]
    elapsed, val = 0.0, []
    for r in history:  # (step, training seconds so far, validation loss)
        elapsed += r["step_time_s"]
        if "val_loss" in r:
            val.append((r["step"], elapsed, r["val_loss"]))
    out = {
        "kind": kind,
        "mode": mode,
        "step_s": statistics.median(times),
        "root_bytes_per_step": root,
        "load": os.getloadavg()[0],
        "val": val,
    }
    print(f"{kind} {mode} over {args.mbit:g} Mbit/s: {json.dumps(out)}", flush=True)
    return out


def time_to(val: list[tuple[int, float, float]], target: float) -> float | None:
    """Training seconds (the steps' times) until the first validation at or below ``target``."""
    return next((t for _, t, loss in val if loss <= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--per-host", type=int, default=2)
    parser.add_argument("--per-worker", type=int, default=2, help="samples per worker per step")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--mbit", type=float, default=200.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--async", dest="run_async", action="store_true")
    parser.add_argument("--async-steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    for kind in (*KINDS, *reversed(KINDS)):  # ABBA
        runs[kind].append(run(kind, args))
    step = {k: statistics.mean(r["step_s"] for r in v) for k, v in runs.items()}
    root = {k: statistics.mean(r["root_bytes_per_step"] for r in v) for k, v in runs.items()}
    result: dict[str, Any] = {
        "setup": vars(args) | {"out": str(args.out) if args.out else None},
        "runs": runs,
        "step_s": step,
        "root_bytes_per_step": root,
        "flat_over_leaves": step["flat"] / step["leaves"],
        "leaves_over_allreduce_push": step["leaves"] / step["allreduce-push"],
    }
    if args.run_async:
        args.steps, args.eval_every = args.async_steps, max(1, args.async_steps // 12)
        pair = {m: run("leaves", args, mode=m) for m in ("sync", "async")}
        target = max(min(loss for _, _, loss in r["val"]) for r in pair.values()) * 1.02
        result["async"] = {
            "target_val_loss": target,
            **{m: {"time_to_target_s": time_to(r["val"], target), **r} for m, r in pair.items()},
        }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_node":
        _node(sys.argv[2])
    else:
        main()

"""Sufficient-factor exchange against plain DDP: bytes sent per step and step time.

Question: on wide linear layers (4096 x 4096) with a small per-rank batch, how many fewer bytes
does the factor all-gather send than DDP's gradient all-reduce, and is the step faster when the
link is the bottleneck? Both run in the same processes, from the same initial weights on the
same data, interleaved; their final weights are compared (they must agree to float rounding).

Links: ``loopback`` (the ranks talk over ``lo``, as fast as memory copies allow) and ``link``
(each rank in its own network namespace, joined by veth pairs to a bridge, every rank's egress
capped by a ``tc tbf`` qdisc at ``--rate``; needs root and ``ip``/``tc``). Bytes are per rank,
counted by `comm.sufficient_factor` for the gathers and computed as the ring all-reduce volume
for DDP's buckets (see that module's docstring).

Run: python benchmarks/sufficient_factor/main.py [--links loopback,link] [--rate 1gbit]
     [--width 4096] [--layers 2] [--rows 8] [--world 2] [--steps 6] [--reps 2] [--results PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
NS = "pfsf"  # prefix of the namespaces, bridge and veths this script creates (and deletes)


def _model(width: int, layers: int) -> Any:
    from torch import nn

    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU()]
    return nn.Sequential(*blocks)


def _bench(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Runs on every rank once the process group exists; returns rank 0's measurements."""
    import torch
    import torch.distributed as dist

    from polytrain.comm.mesh import build_mesh
    from polytrain.comm.sufficient_factor import ring_all_reduce_bytes, traffic
    from polytrain.config.job import ParallelConfig
    from polytrain.parallel.data_parallel import apply_data_parallel
    from polytrain.parallel.sufficient_factor import apply_sufficient_factor
    from polytrain.topology import ParallelDims

    torch.set_num_threads(1)
    width, layers, rows = cfg["width"], cfg["layers"], cfg["rows"]
    mesh = build_mesh(ParallelDims(dp=world))
    pcfg = ParallelConfig(dp=world)
    torch.manual_seed(0)
    init = _model(width, layers).state_dict()

    def data(step: int) -> torch.Tensor:  # this rank's rows of the global batch of ``step``
        g = torch.Generator().manual_seed(step)
        return torch.randn(world * rows, width, generator=g)[rank * rows : (rank + 1) * rows]

    runs: dict[str, Any] = {}
    for mode in ("ddp", "sf"):
        model = _model(width, layers)
        model.load_state_dict(init)
        ddp_params = list(model.parameters())
        chosen: list[str] = []
        if mode == "sf":
            plan = apply_sufficient_factor(model, mesh, "auto", data(0), rows)
            chosen = plan.chosen
            names = set(plan.allreduce_params)
            ddp_params = [p for n, p in model.named_parameters() if n in names]
        wrapped = apply_data_parallel(model, mesh, pcfg)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        ddp_bytes = ring_all_reduce_bytes(sum(p.numel() * 4 for p in ddp_params), world)
        runs[mode] = dict(model=model, wrapped=wrapped, opt=opt, chosen=chosen)
        runs[mode].update(ddp_bytes=ddp_bytes, times=[], sf_bytes=[], step=0)

    def step(run: dict[str, Any]) -> None:
        run["opt"].zero_grad(set_to_none=True)
        run["wrapped"](data(run["step"])).square().mean().backward()
        run["opt"].step()
        run["step"] += 1

    for run in runs.values():  # warm-up (buckets rebuilt after the first step)
        for _ in range(2):
            step(run)
    for _ in range(cfg["reps"]):  # interleaved, so drift in load hits both alike
        for run in runs.values():
            traffic.reset()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(cfg["steps"]):
                step(run)
            dist.barrier()
            run["times"].append((time.perf_counter() - t0) / cfg["steps"])
            run["sf_bytes"].append(traffic.bytes_sent / cfg["steps"])
    ddp, sf = runs["ddp"], runs["sf"]
    diff = max(
        float((a.detach() - b.detach()).abs().max())
        for a, b in zip(ddp["model"].parameters(), sf["model"].parameters(), strict=True)
    )
    out: dict[str, Any] = {"max_abs_weight_diff": diff, "sf_layers": sf["chosen"]}
    for name, run in runs.items():
        out[f"{name}_step_s"] = statistics.median(run["times"])
        out[f"{name}_bytes_per_step"] = run["ddp_bytes"] + statistics.median(run["sf_bytes"])
    return out


# -- loopback: the shipped harness (file rendezvous, gloo on lo) ------------------------------


def _loopback(world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from polytrain.testing import run_distributed

    result: dict[str, Any] = run_distributed(_bench, world, cfg, timeout_s=900)[0]
    return result


# -- link: one network namespace per rank, a bridge, egress capped by tc tbf ------------------


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@contextlib.contextmanager
def _namespaces(world: int, rate: str) -> Iterator[list[str]]:
    """Namespaces ``pfsf0..`` with addresses 10.231.0.(r+1) on a bridge in namespace ``pfsfbr``."""
    made: list[str] = []
    try:
        _sh("ip", "netns", "add", f"{NS}br")
        made.append(f"{NS}br")
        _sh("ip", "-n", f"{NS}br", "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", f"{NS}br", "link", "set", "br0", "up")
        for r in range(world):
            ns = f"{NS}{r}"
            _sh("ip", "netns", "add", ns)
            made.append(ns)
            _sh("ip", "link", "add", f"{NS}v{r}", "type", "veth", "peer", "name", f"{NS}p{r}")
            _sh("ip", "link", "set", f"{NS}v{r}", "netns", ns)
            _sh("ip", "link", "set", f"{NS}p{r}", "netns", f"{NS}br")
            _sh("ip", "-n", f"{NS}br", "link", "set", f"{NS}p{r}", "master", "br0", "up")
            _sh("ip", "-n", ns, "addr", "add", f"10.231.0.{r + 1}/24", "dev", f"{NS}v{r}")
            _sh("ip", "-n", ns, "link", "set", f"{NS}v{r}", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            # the rank's NIC: egress rate-limited; ingress is the peers' egress, limited there
            tbf = ["tbf", "rate", rate, "burst", "256kb", "latency", "100ms"]
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", f"{NS}v{r}", "root", *tbf)
        yield [f"{NS}{r}" for r in range(world)]
    finally:
        for ns in reversed(made):  # deleting a namespace deletes its veth ends and the bridge
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _worker(args: argparse.Namespace) -> None:
    """One rank of the ``link`` run, started inside its namespace by `_link`."""
    import datetime

    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = f"{NS}v{args.rank}"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://10.231.0.1:{args.port}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=600),
    )
    cfg = json.loads(args.cfg)
    try:
        out = _bench(args.rank, args.world, cfg)
    finally:
        dist.destroy_process_group()
    if args.rank == 0:
        Path(args.out).write_text(json.dumps(out))


def _link(world: int, cfg: dict[str, Any], rate: str) -> dict[str, Any]:
    with _namespaces(world, rate) as namespaces, tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        worker = [sys.executable, __file__, "--worker", "--world", str(world)]
        worker += ["--cfg", json.dumps(cfg), "--out", str(out)]
        procs = [
            subprocess.Popen(["ip", "netns", "exec", ns, *worker, "--rank", str(r)], env=env)
            for r, ns in enumerate(namespaces)
        ]
        codes = [p.wait(timeout=900) for p in procs]
        if any(codes):
            raise RuntimeError(f"link run failed: exit codes {codes}")
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", default="loopback,link")
    parser.add_argument("--rate", default="1gbit", help="tc tbf rate of each rank's egress")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=8, help="rows per rank per step")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--results", default=str(HERE / "results.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29611, help=argparse.SUPPRESS)
    parser.add_argument("--cfg", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return

    cfg = {k: getattr(args, k) for k in ("width", "layers", "rows", "steps", "reps")}
    result: dict[str, Any] = {
        "world": args.world,
        **cfg,
        "model": f"{args.layers} x (Linear {args.width}x{args.width} + LayerNorm + ReLU)",
    }
    for link in args.links.split(","):
        r = _loopback(args.world, cfg) if link == "loopback" else _link(args.world, cfg, args.rate)
        r["bytes_ratio"] = r["ddp_bytes_per_step"] / r["sf_bytes_per_step"]
        r["speedup"] = r["ddp_step_s"] / r["sf_step_s"]
        if link == "link":
            r["rate"] = args.rate
        result[link] = r
        print(json.dumps({link: r}, indent=2), flush=True)
    Path(args.results).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

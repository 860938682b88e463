"""Multi-host communication on an emulated cluster (issue 16): results as ratios and a curve.

Runs every experiment on hosts that are network namespaces behind one switch, each host's link
rate-limited with ``tc tbf`` (polytrain.testing.cluster), one gloo process per rank started in
its host's namespace. Needs root. See README.md for the questions, the command and the results.

    python3 benchmarks/multihost/main.py            # everything -> results.json, curve.png
    python3 benchmarks/multihost/main.py --quick    # smaller messages, fewer repetitions
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
PORT = 29620
MIB = 1 << 20


# ----------------------------------------------------------------------------- worker side
def _time(fn: Any, reps: int) -> float:
    """Median seconds of ``fn()`` after a warm-up; the slowest rank's (all ranks agree)."""
    import torch
    import torch.distributed as dist

    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _groups(rank_lists: list[list[int]]) -> Any:
    """Create every group (collective over the world); return this rank's."""
    import torch.distributed as dist

    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def _exp_hierarchical(spec: dict[str, Any]) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from polytrain.comm.hierarchical import hierarchical_all_reduce, host_groups

    world = dist.get_world_size()
    groups = host_groups([list(range(world))], dist.group.WORLD, spec["per_host"])
    x = torch.ones(spec["numel"])
    flat = _time(lambda: dist.all_reduce(x), spec["reps"])
    tiered = _time(lambda: hierarchical_all_reduce(x, groups), spec["reps"])
    latency = _time(lambda: dist.all_reduce(torch.ones(1)), spec["reps"] * 3)
    return {"flat_s": flat, "hierarchical_s": tiered, "latency_s": latency}


def _exp_placement(spec: dict[str, Any]) -> dict[str, float]:
    """Replay one step's communication of dp x tp or dp x pp under two placements.

    ``inner``: the axis whose groups hold consecutive ranks (one host); the other axis crosses
    hosts. tp: ``4 * layers`` all-reduces of one activation (Megatron's f/g, forward and
    backward) in the tp group, then the dp all-reduce of the gradient shard (params / tp).
    pp (two stages): each micro-batch's activation forward and its gradient back between the
    stages, then the dp all-reduce of the stage's gradients (params / 2).
    """
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    inner_size = spec["per_host"]
    blocks = [list(range(i, i + inner_size)) for i in range(0, world, inner_size)]
    strided = [list(range(i, world, inner_size)) for i in range(inner_size)]
    out = {}
    for placement, (axis_groups, dp_groups) in {
        "aware": (blocks, strided) if spec["axis"] == "tp" else (strided, blocks),
        "naive": (strided, blocks) if spec["axis"] == "tp" else (blocks, strided),
    }.items():
        axis_group, dp_group = _groups(axis_groups), _groups(dp_groups)
        axis_ranks = next(g for g in axis_groups if rank in g)
        act = torch.ones(spec["act_numel"])
        grads = torch.ones(spec["param_numel"] // 2)
        step = functools.partial(_replay_step, spec, act, grads, axis_group, axis_ranks, dp_group)
        out[f"{placement}_s"] = _time(step, spec["reps"])
    return out


def _replay_step(
    spec: dict[str, Any],
    act: Any,
    grads: Any,
    axis_group: Any,
    axis_ranks: list[int],
    dp_group: Any,
) -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    if spec["axis"] == "tp":
        for _ in range(4 * spec["layers"]):
            dist.all_reduce(act, group=axis_group)
    else:  # two stages: axis_ranks[0] sends activations, gets gradients back
        peer = axis_ranks[1] if rank == axis_ranks[0] else axis_ranks[0]
        for _ in range(spec["microbatches"]):
            if rank == axis_ranks[0]:
                dist.send(act, peer)
                dist.recv(act, peer)
            else:
                dist.recv(act, peer)
                dist.send(act, peer)
    dist.all_reduce(grads, group=dp_group)


def _exp_exchange(spec: dict[str, Any]) -> dict[str, float]:
    """Gradient exchange of ``numel`` floats, one rank per host: central reducer (rank 0 is the
    server), ``servers`` parameter-server shards on the first hosts, ring all-reduce."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.ones(spec["numel"])

    def sharded(num_servers: int) -> None:
        shards = list(x.chunk(num_servers))
        # Push: every rank sends shard s to server s; each server sums what arrives.
        ops = []
        bufs: dict[int, list[torch.Tensor]] = {}
        for s, shard in enumerate(shards):
            if rank == s:
                bufs[s] = [torch.empty_like(shard) for _ in range(world)]
                ops += [dist.P2POp(dist.irecv, bufs[s][r], r) for r in range(world) if r != s]
            else:
                ops.append(dist.P2POp(dist.isend, shard, s))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        for s in bufs:
            shards[s].add_(torch.stack([b for r, b in enumerate(bufs[s]) if r != s]).sum(0))
        # Pull: every server sends its summed shard back to every rank.
        ops = []
        for s, shard in enumerate(shards):
            if rank == s:
                ops += [dist.P2POp(dist.isend, shard, r) for r in range(world) if r != s]
            else:
                ops.append(dist.P2POp(dist.irecv, shard, s))
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    servers = max(1, min(spec["servers"], world))
    return {
        "central_s": _time(lambda: sharded(1), spec["reps"]),
        "sharded_s": _time(lambda: sharded(servers), spec["reps"]),
        "ring_s": _time(lambda: dist.all_reduce(x), spec["reps"]),
        "latency_s": _time(lambda: dist.all_reduce(torch.ones(1)), spec["reps"] * 3),
    }


EXPERIMENTS = {
    "hierarchical": _exp_hierarchical,
    "placement": _exp_placement,
    "exchange": _exp_exchange,
}


def worker(spec_path: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo")
    result = EXPERIMENTS[spec["experiment"]](spec)
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(result))
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver side
def run_on_cluster(num_hosts: int, per_host: int, rate_mbit: float, spec: dict[str, Any]) -> Any:
    """Start ``num_hosts * per_host`` ranks of ``spec`` on a fresh emulated cluster."""
    from polytrain.testing.cluster import Cluster, LinkSpec

    with (
        tempfile.TemporaryDirectory() as tmp,
        Cluster(num_hosts, link=LinkSpec(rate_mbit=rate_mbit)) as cluster,
    ):
        out = Path(tmp) / "result.json"
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps({**spec, "out": str(out), "per_host": per_host}))
        cluster.run_ranks(
            [rank // per_host for rank in range(num_hosts * per_host)],
            [sys.executable, str(Path(__file__).resolve()), "worker", str(spec_path)],
            port=PORT,
            pythonpath=str(SRC),
            timeout_s=600,
            what=f"a {spec['experiment']} rank",
        )
        return json.loads(out.read_text())


def alpha_beta(
    n: int, numel: int, rate_mbit: float, alpha: float, servers: int
) -> dict[str, float]:
    """Seed 002's model, per link direction at ``rate_mbit``: bytes on the busiest link / rate,
    plus ``alpha`` per sequential message step."""
    nbytes = 4 * numel
    beta = 8 / (rate_mbit * 1e6)  # seconds per byte
    s = min(servers, n)
    return {
        # push (n-1) gradients into the server's link, then pull (n-1) copies out
        "central_s": 2 * alpha + 2 * (n - 1) * nbytes * beta,
        # each server takes (n-1)/s of a gradient in and sends as much out
        "sharded_s": 2 * alpha + 2 * (n - 1) * nbytes * beta / s,
        # 2(n-1) steps of nbytes/n each
        "ring_s": 2 * (n - 1) * (alpha + nbytes / n * beta),
    }


def planner_env(num_hosts: int, per_host: int, rate_mbit: float, alpha: float) -> Any:
    """The planner's view of the emulated cluster (issue 16, item 4).

    Inside a host: the catalog's loopback link. Between hosts: each host has ONE shaped link
    (``nic = "host"``, [Note: shared host link] in planner/cluster.py), with the measured
    one-float all-reduce time as the per-hop latency."""
    from polytrain.planner.catalog import Link, device, link
    from polytrain.planner.cluster import Cluster
    from polytrain.planner.cost.common import Env

    inter = Link(
        key=f"tbf{rate_mbit:g}",
        name=f"tbf-shaped veth, {rate_mbit:g} Mbit/s per host",
        bandwidth=rate_mbit * 1e6 / 8,
        latency=alpha,
    )
    cpu = device("cpu")
    return Env(Cluster(num_hosts, per_host, cpu, link(cpu.intra_link), inter, None, nic="host"))


def planner_placement(spec: dict[str, Any], env: Any) -> dict[str, float]:
    """The planner's seconds for `_replay_step` under both placements: the same collectives,
    each priced by `Env.collective_s` / `p2p_s` for its group's stride, which decides (through
    `Cluster.link_for`) whether the group crosses hosts."""
    act, grads = 4 * spec["act_numel"], 4 * (spec["param_numel"] // 2)
    per_host = env.cluster.per_host
    out = {}
    for placement, axis_stride in (("aware", 1), ("naive", per_host)):
        if spec["axis"] == "pp":  # the aware placement puts the stages across hosts
            axis_stride = per_host if placement == "aware" else 1
        dp_stride = per_host if axis_stride == 1 else 1
        if spec["axis"] == "tp":
            axis_s = 4 * spec["layers"] * env.collective_s("all_reduce", act, 2, axis_stride)
        else:
            axis_s = 2 * spec["microbatches"] * env.p2p_s(act, axis_stride)
        out[f"{placement}_s"] = axis_s + env.collective_s("all_reduce", grads, 2, dp_stride)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller messages, fewer reps")
    parser.add_argument("--out", type=Path, default=HERE / "results.json")
    parser.add_argument("--png", type=Path, default=HERE / "curve.png")
    parser.add_argument("--max-hosts", type=int, default=6)
    args = parser.parse_args()
    sys.path.insert(0, str(SRC))
    reps = 2 if args.quick else 3
    scale = 4 if args.quick else 1
    results: dict[str, Any] = {"ratios": [], "curve": [], "planner": []}
    for rate in (1000, 100):
        numel = (4 * MIB // 4) // scale  # 4 MiB of gradients
        flat = run_on_cluster(
            2, 2, rate, {"experiment": "hierarchical", "numel": numel, "reps": reps}
        )
        results["ratios"].append({"what": "flat / hierarchical all-reduce, 2 hosts x 2",
                                  "rate_mbit": rate, "bytes": 4 * numel, **flat,
                                  "ratio": flat["flat_s"] / flat["hierarchical_s"]})  # fmt: skip
        env = planner_env(2, 2, rate, flat["latency_s"] / 2)
        results["planner"].append({"what": "flat all-reduce, 2 hosts x 2", "rate_mbit": rate,
                                   "measured_s": flat["flat_s"],
                                   "planner_s": env.collective_s("all_reduce", 4 * numel, 4)})  # fmt: skip
        for axis in ("tp", "pp"):
            spec = {
                "experiment": "placement",
                "axis": axis,
                "reps": reps,
                "layers": 4,
                "microbatches": 4,
                # gpt-like: C=256, T=128, 8 sequences per replica; 12 C^2 params per layer
                "act_numel": (8 * 128 * 256) // (4 if axis == "pp" else 1) // scale,
                "param_numel": 12 * 256 * 256 * 4 // scale,
            }
            got = run_on_cluster(2, 2, rate, spec)
            results["ratios"].append({"what": f"naive / topology-aware placement, dp2 x {axis}2",
                                      "rate_mbit": rate, **got,
                                      "ratio": got["naive_s"] / got["aware_s"]})  # fmt: skip
            print(results["ratios"][-1], flush=True)
            predicted = planner_placement(spec, env)
            for placement in ("aware", "naive"):
                results["planner"].append({"what": f"dp2 x {axis}2 step, {placement} placement",
                                           "rate_mbit": rate,
                                           "measured_s": got[f"{placement}_s"],
                                           "planner_s": predicted[f"{placement}_s"]})  # fmt: skip
    numel = (4 * MIB // 4) // scale
    for n in range(2, args.max_hosts + 1):
        got = run_on_cluster(
            n, 1, 1000, {"experiment": "exchange", "numel": numel, "reps": reps, "servers": 2}
        )
        model = alpha_beta(n, numel, 1000, got["latency_s"] / 2, 2)
        results["curve"].append({"hosts": n, "bytes": 4 * numel, **got,
                                 "model": model})  # fmt: skip
        print(results["curve"][-1], flush=True)
        env = planner_env(n, 1, 1000, got["latency_s"] / 2)
        results["planner"].append({"what": f"ring all-reduce, {n} hosts x 1", "rate_mbit": 1000,
                                   "measured_s": got["ring_s"],
                                   "planner_s": env.collective_s("all_reduce", 4 * numel, n)})  # fmt: skip
    for row in results["planner"]:
        row["planner_over_measured"] = row["planner_s"] / row["measured_s"]
        print(row, flush=True)
    args.out.write_text(json.dumps(results, indent=1))
    plot(results["curve"], args.png)


def plot(curve: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hosts = [c["hosts"] for c in curve]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label, colour in (
        ("central_s", "central reducer (PS, 1 server)", "C0"),
        ("sharded_s", "PS, 2 servers", "C1"),
        ("ring_s", "ring all-reduce (gloo)", "C2"),
    ):
        ax.plot(hosts, [c[key] for c in curve], "o-", color=colour, label=f"{label}: measured")
        ax.plot(hosts, [c["model"][key] for c in curve], "--", color=colour, label="alpha-beta")
    ax.set_xlabel("hosts (one rank each, 1 Gbit/s links)")
    ax.set_ylabel(f"exchange time of {curve[0]['bytes'] / MIB:g} MiB, s")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        worker(sys.argv[2])
    else:
        main()

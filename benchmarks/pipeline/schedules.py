"""Interleaved 1F1B, ZB-H1 and ZBV: polytrain's runtime against torch.distributed.pipelining.

Interleaved 1F1B (Narayanan et al. SC'21) and the zero-bubble ZB-H1 and ZBV (Qi et al. ICLR
2024). Questions, for each schedule on the same model, stages, micro-batches and processes:

1. Step time of polytrain's runtime against torch's implementation of the same schedule
   driving the very same stage modules (target: ours / torch time <= 1, throughput >= 1):
   ``ScheduleInterleaved1F1B`` (stage ``s`` on rank ``s % p``), ``ScheduleInterleavedZeroBubble``
   with one stage per rank (torch's ZB1P) and ``ScheduleZBVZeroBubble`` (two stages per rank
   in a V). The script checks that torch runs each schedule's F, B, I and W in our order.
2. The measured bubble (idle fraction of ranks x step, from polytrain's trace spans) against
   the schedule's formula with the papers' unit times; the F, B, I and W times measured per
   stage, and ``(I + W) / B`` on the same stage, say how far this run is from those times.
3. Rank 0's peak activation bytes (counted by the runtime) against 1F1B's on the same model,
   and against the schedule's peak weighed by each stage's bytes per micro-batch.

Run: python benchmarks/pipeline/schedules.py [--world 2] [--virtual-stages 2] [--microbatches 8]
     [--steps 12] [--reps 6] [--schedules interleaved-1f1b,zb-h1,zbv] [--model gpt|mlp]
     [--n-layer 8] [--partition 3,2,2,3]

Helpers shared with ``main.py`` (GPipe and 1F1B against torch): the job, torch's side of a
schedule, the interleaved timing loop and the bubble.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:  # run as a script: ``benchmarks.*`` from this checkout
    sys.path.insert(0, str(ROOT))

from benchmarks.pipeline.main import _bubbles, _job, time_interleaved, torch_stepper  # noqa: E402

NEW_SCHEDULES = ("interleaved-1f1b", "zb-h1", "zbv")
TORCH_CLASSES = {
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}


def _rank(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.pipelining as pipelining

    from polytrain.comm.init import init_distributed
    from polytrain.comm.mesh import build_mesh
    from polytrain.data import Batches, build_datasets
    from polytrain.models.registry import block_size_of, build_model
    from polytrain.pipeline.family import pipeline_strategy
    from polytrain.pipeline.schedule import stages_per_rank
    from polytrain.pipeline.strategy import PipelineStrategy
    from polytrain.topology import ParallelDims

    m, steps, reps, v = args["microbatches"], args["steps"], args["reps"], args["virtual_stages"]
    ctx = init_distributed()
    total_steps = (reps + 1) * steps
    extra = {"model": {"n_layer": args["n_layer"]}} if args["n_layer"] else {}
    base = _job(world, "1f1b", m, total_steps, args["model"], **extra)
    train_set, val_set, spec = build_datasets(base.data, block_size_of(base.model))
    batches = Batches(train_set, val_set, base.train.global_batch_size, base.train.seed)
    dims = ParallelDims(pp=world)

    def ours(schedule: str, track: bool = False) -> PipelineStrategy:
        pipeline: dict[str, Any] = {"virtual_stages": v} if schedule == "interleaved-1f1b" else {}
        counts = args["partition"]
        if counts and len(counts) == world * stages_per_rank(schedule, v):
            pipeline["partition"] = counts
        job = _job(world, schedule, m, total_steps, args["model"], pipeline=pipeline, **extra)
        model = build_model(job.model, spec, job.train.seed)
        strategy = pipeline_strategy(job, model, build_mesh(dims), batches, ctx.device)
        strategy.runtime.track_activations = track
        return strategy

    names = ("1f1b", *args["schedules"])
    strategies = {name: ours(name) for name in names}
    steppers: dict[str, Any] = {"ours_1f1b": strategies["1f1b"].train_step}
    # torch's 1F1B on the same stages too: the best schedule of each runtime is compared
    one_f_one_b = torch_stepper(
        pipelining.Schedule1F1B,
        build_model(base.model, spec, base.train.seed),
        strategies["1f1b"].ranges,
        strategies["1f1b"].stage_indices,
        batches,
        m,
        base.optim,
        ctx.device,
    )
    steppers["torch_1f1b"] = one_f_one_b.step
    refused: dict[str, str] = {}
    same_order: dict[str, bool] = {}
    torch_times: dict[str, dict[str, dict[str, list[float]]]] = {}
    for name in args["schedules"]:
        strategy = strategies[name]
        steppers[f"ours_{name}"] = strategy.train_step
        try:
            model = build_model(base.model, spec, base.train.seed)
            theirs = torch_stepper(
                getattr(pipelining, TORCH_CLASSES[name]),
                model,
                strategy.ranges,
                strategy.stage_indices,
                batches,
                m,
                base.optim,
                ctx.device,
            )
            steppers[f"torch_{name}"] = theirs.step
            same_order[name] = _same_compute_order(
                name, world, m, v, theirs.schedule.pipeline_order
            )
            torch_times[name] = _time_torch_actions(theirs.stages)
        except Exception as error:  # refused on construction (every rank alike): ours still runs
            refused[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
            steppers.pop(f"torch_{name}", None)
    samples, step_times, losses = time_interleaved(steppers, reps, steps, alternate=True)

    # Rank 0's live activation bytes under each schedule (two steps, counting on).
    memory = {}
    for name in names:
        tracked = ours(name, track=True)
        for t in range(2):
            tracked.train_step(t)
        memory[name] = tracked.runtime.stats.peak_activation_bytes

    ranges = {name: s.ranges for name, s in strategies.items()}
    model = build_model(base.model, spec, base.train.seed)
    return {
        "samples_per_s": samples,
        "step_s": step_times,
        "last_loss": losses,
        "refused": refused,
        "same_compute_order_as_torch": same_order,
        "torch_action_ms": {
            name: {k: {st: statistics.median(d) for st, d in by.items()} for k, by in t.items()}
            for name, t in torch_times.items()
        },
        "peak_activation_bytes": memory,
        "events": {name: s.tracer.events for name, s in strategies.items()},
        "ranges": ranges,
        "stage_bytes": _stage_bytes(model, ranges, batches, m) if rank == 0 else {},
    }


def _time_torch_actions(stages: list[Any]) -> dict[str, dict[str, list[float]]]:
    """Wrap each torch ``PipelineStage``'s F, B (I when not ``full_backward``) and W with a
    clock; returns the milliseconds they will record per kind and stage (warm-up included:
    the medians taken of them are robust to one repetition in seven)."""
    times: dict[str, dict[str, list[float]]] = {}

    def timed(fn: Any, kind: str, stage: int) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            k = "I" if kind == "B" and not kwargs.get("full_backward", True) else kind
            times.setdefault(k, {}).setdefault(str(stage), []).append(
                (time.perf_counter() - t0) * 1e3
            )
            return out

        return run

    for pipe in stages:
        for kind, attr in (
            ("F", "forward_one_chunk"),
            ("B", "backward_one_chunk"),
            ("W", "backward_weight_one_chunk"),
        ):
            setattr(pipe, attr, timed(getattr(pipe, attr), kind, pipe.stage_index))
    return times


def _same_compute_order(name: str, p: int, m: int, v: int, torch_order: Any) -> bool:
    """Whether every rank runs torch's F, B, I and W in the order of polytrain's schedule (then
    the comparison is of the runtimes alone). Torch's ``pipeline_order`` prints its actions as
    ours do (``"2F0"``, ``"2B0"`` a full backward); its ``None`` are idle slots."""
    from polytrain.pipeline.schedule import build_staged

    ours, _ = build_staged(name, p, m, virtual_stages=v)
    return all(
        [str(a) for a in torch_order[r] if a is not None]
        == [str(a) for a in ours[r] if a is not None]
        for r in range(p)
    )


def _stage_bytes(
    model: Any, ranges: dict[str, list[tuple[int, int]]], batches: Any, m: int
) -> dict[str, list[int]]:
    """Per schedule, the bytes autograd saves for one micro-batch on each of its stages,
    counted as the runtime counts them ([Note: activation accounting]), the last with its loss."""
    from polytrain.pipeline.saved_tensors import count_saved_bytes, storage_keys
    from polytrain.pipeline.stage import build_stage

    x, y = batches.train(0, 0, 1, 0, m)
    out: dict[str, list[int]] = {}
    for name, stage_ranges in ranges.items():
        sizes, h = [], x
        for start, stop in stage_ranges:
            stage = build_stage(model, start, stop)
            h = h.detach().requires_grad_(h.is_floating_point())
            with count_saved_bytes(storage_keys(stage.parameters())) as saved:
                h = stage(h)
                if stop == model.num_blocks:
                    model.loss_fn(h, y)
            sizes.append(saved.bytes)
        out[name] = sizes
    return out


def _durations_ms(
    events: list[list[dict[str, Any]]], skip_first: int
) -> dict[str, dict[str, float]]:
    """Median milliseconds of each compute kind on each stage (``{"F": {"0": 10.2, ...}}``)."""
    found: dict[str, dict[str, list[float]]] = {}
    for rank_events in events:
        for e in rank_events:
            a = e["args"]
            if e["name"] in ("F", "B", "I", "W") and "stage" in a and a["step"] >= skip_first:
                found.setdefault(e["name"], {}).setdefault(str(a["stage"]), []).append(e["dur"])
    return {
        kind: {s: statistics.median(d) / 1e3 for s, d in sorted(by_stage.items())}
        for kind, by_stage in sorted(found.items())
    }


def _formula(name: str, p: int, m: int, v: int) -> tuple[float, str]:
    """The schedule's bubble as a fraction of ranks x step (idle over idle + busy), from its
    formula with the papers' unit times (the ratios ``x`` are idle over busy: ``x / (1 + x)``)."""
    from polytrain.pipeline.schedule import (
        bubble_fraction,
        interleaved_bubble_ratio,
        zb_h1_idle_time,
        zbv_idle_steps,
    )

    if name == "1f1b":
        return bubble_fraction(p, m), "(p - 1) / (m + p - 1)"
    if name == "interleaved-1f1b":
        x = interleaved_bubble_ratio(p, m, v)
        return x / (1 + x), "x / (1 + x), x = (p - 1) / (v m)"
    if name == "zb-h1":
        x = zb_h1_idle_time(p, 1, 1, 1) / (3 * m)
        text = "x / (1 + x), x = (p - 1)(T_F + T_I - T_W) / (m (T_F + T_I + T_W)), T = 1"
        return x / (1 + x), text
    x = zbv_idle_steps(p) / (6 * m)
    return x / (1 + x), "x / (1 + x), x = (p - 1) / (6 m), unit chunk times"


def _rank_idle(events: list[list[dict[str, Any]]], skip_first: int) -> list[float]:
    """Per rank, the median over steps of its idle share of the step's window (the window of
    `main._bubbles`: first compute start to last compute end over all ranks)."""
    compute = [
        e for r in events for e in r if e["name"] in ("F", "B", "I", "W") and "stage" in e["args"]
    ]
    steps = sorted({e["args"]["step"] for e in compute})[skip_first:]
    ranks = sorted({e["pid"] for e in compute})
    idle: dict[int, list[float]] = {r: [] for r in ranks}
    for step in steps:
        spans = [e for e in compute if e["args"]["step"] == step]
        start = min(e["ts"] for e in spans)
        window = max(e["ts"] + e["dur"] for e in spans) - start
        for r in ranks:
            idle[r].append(1 - sum(e["dur"] for e in spans if e["pid"] == r) / window)
    return [statistics.median(idle[r]) for r in ranks]


def _split_cost(
    durations: dict[str, dict[str, dict[str, float]]], partitions: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Per schedule with a split backward, ``(I + W) / B`` on each stage, B from a schedule
    of this run with the same partition and a full backward (``b_from``)."""
    out: dict[str, dict[str, Any]] = {}
    for name, kinds in durations.items():
        if "I" not in kinds:
            continue
        peer = next(
            (n for n, k in durations.items() if "B" in k and partitions[n] == partitions[name]),
            None,
        )
        if peer is not None:
            b = durations[peer]["B"]
            ratios = {s: (kinds["I"][s] + kinds["W"][s]) / b[s] for s in kinds["I"]}
            out[name] = {"b_from": peer, "per_stage": ratios}
    return out


def _peak_formula_vs_1f1b(name: str, p: int, m: int, v: int) -> float:
    """Rank 0's peak over 1F1B's by the formulas, all chunks of one size (1F1B's ``min(p, m)``
    whole stages, a stage being ``v`` chunks of interleaved 1F1B or 2 of ZBV)."""
    from polytrain.pipeline.schedule import (
        interleaved_peak_activations,
        zb_h1_peak_activations,
        zbv_peak_activations,
    )

    one_f_one_b = min(p, m)
    if name == "interleaved-1f1b":
        return interleaved_peak_activations(0, p, m, v) / (v * one_f_one_b)
    if name == "zb-h1":
        return zb_h1_peak_activations(p, m) / one_f_one_b
    if name == "zbv":
        return zbv_peak_activations(p) / (2 * one_f_one_b)
    return 1.0


def _expected_peak(name: str, p: int, m: int, v: int, stage_bytes: list[int]) -> float:
    """Rank 0's peak bytes: the schedule's program order weighed by each stage's bytes."""
    from polytrain.pipeline.schedule import build_staged, peak_activation_memory

    schedule, _ = build_staged(name, p, m, virtual_stages=v)
    return peak_activation_memory(schedule, lambda s: float(stage_bytes[s]))[0]


def torch_version() -> str:
    import torch

    return str(torch.__version__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="pipeline ranks (= processes)")
    parser.add_argument("--virtual-stages", type=int, default=2, help="interleaved 1F1B's v")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12, help="steps per timed repetition")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--schedules", default=",".join(NEW_SCHEDULES))
    parser.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    parser.add_argument(
        "--n-layer", type=int, default=8, help="transformer layers of gpt tiny (0: its own 4)"
    )
    # [Note: balanced stages] gpt tiny with 8 layers is 10 blocks (embedding, 8 layers, head).
    # Uniform counts on 4 stages ([3, 3, 2, 2]) would leave ZBV's rank 0 (stages 0 and 3) 3
    # layers against rank 1's 5; [3, 2, 2, 3] gives every stage 2 layers, so each rank holds 4
    # under both placements, and the 2-stage schedules' uniform [5, 5] holds 4 per rank too.
    parser.add_argument(
        "--partition",
        default="3,2,2,3",
        help="blocks per stage for the schedules with that many stages (others: uniform); "
        "'uniform' for all (default: gpt with 8 layers; mlp: uniform)",
    )
    args = parser.parse_args()
    schedules = tuple(s for s in args.schedules.split(",") if s)
    unknown = [s for s in schedules if s not in NEW_SCHEDULES]
    if unknown:
        parser.error(f"--schedules {','.join(unknown)}: expected some of {','.join(NEW_SCHEDULES)}")
    if args.model != "gpt":
        args.n_layer, args.partition = 0, "uniform"
    partition = [] if args.partition == "uniform" else [int(c) for c in args.partition.split(",")]

    from polytrain.testing import run_distributed

    p, m, v = args.world, args.microbatches, args.virtual_stages
    options = vars(args) | {"schedules": schedules, "partition": partition}
    load_before = os.getloadavg()
    results = run_distributed(_rank, p, options, timeout_s=1800, collective_timeout_s=600)
    r0 = results[0]
    step_s = {k: statistics.median(t) for k, t in r0["step_s"].items()}
    best = {k: max(s) for k, s in r0["samples_per_s"].items()}
    events = {k: [r["events"][k] for r in results] for k in r0["events"]}
    mem = r0["peak_activation_bytes"]
    names = ("1f1b", *schedules)
    durations = {name: _durations_ms(events[name], args.steps) for name in names}
    split_cost = _split_cost(durations, r0["ranges"])
    rows: dict[str, Any] = {}
    for name in names:
        formula, formula_text = _formula(name, p, m, v)
        row: dict[str, Any] = {
            "partition": r0["ranges"][name],
            "ours_median_step_s": step_s[f"ours_{name}"],
            "ours_vs_our_1f1b_time": step_s[f"ours_{name}"] / step_s["ours_1f1b"],
            "bubble_measured": _bubbles(events[name], args.steps),
            "bubble_formula": formula,
            "bubble_formula_text": formula_text,
            "idle_per_rank": _rank_idle(events[name], args.steps),
            "stage_kind_ms": durations[name],
            "i_plus_w_over_b": split_cost.get(name),
            "rank0_peak_activation_bytes": mem[name],
            "rank0_peak_activation_vs_1f1b": mem[name] / mem["1f1b"],
            "rank0_peak_formula_vs_1f1b_equal_chunks": _peak_formula_vs_1f1b(name, p, m, v),
            "rank0_peak_activation_expected_bytes": _expected_peak(
                name, p, m, v, r0["stage_bytes"][name]
            ),
            "stage_activation_bytes_per_microbatch": r0["stage_bytes"][name],
            "ours_last_loss": r0["last_loss"][f"ours_{name}"],
        }
        if name in schedules:
            if name in r0["refused"]:
                row["torch"] = f"{TORCH_CLASSES[name]} did not run: {r0['refused'][name]}"
            else:
                theirs = f"torch_{name}"
                merged: dict[str, dict[str, float]] = {}
                for r in results:
                    for kind, by_stage in r["torch_action_ms"][name].items():
                        merged.setdefault(kind, {}).update(by_stage)
                row |= {
                    "torch_class": TORCH_CLASSES[name],
                    "torch_stage_kind_ms": {k: dict(sorted(d.items())) for k, d in merged.items()},
                    "torch_same_compute_order": r0["same_compute_order_as_torch"][name],
                    "torch_median_step_s": step_s[theirs],
                    "time_ratio_ours_vs_torch": step_s[f"ours_{name}"] / step_s[theirs],
                    "throughput_ratio_ours_vs_torch": step_s[theirs] / step_s[f"ours_{name}"],
                    "best_rep_throughput_ratio": best[f"ours_{name}"] / best[theirs],
                    "torch_last_loss": r0["last_loss"][theirs],
                }
        rows[name] = row
    ours_best = min((k for k in step_s if k.startswith("ours_")), key=step_s.__getitem__)
    torch_best = min((k for k in step_s if k.startswith("torch_")), key=step_s.__getitem__)
    out = {
        "ranks": p,
        "virtual_stages_interleaved": v,
        "microbatches": m,
        "model": f"{args.model}-tiny"
        + (f" with {args.n_layer} layers" if args.n_layer else "")
        + ", global batch 32, AdamW, gloo, 1 thread per rank",
        "steps_per_rep": args.steps,
        "reps": args.reps,
        "cpu_count": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "torch": torch_version(),
        "schedules": rows,
        "torch_1f1b_median_step_s": step_s["torch_1f1b"],
        "torch_1f1b_last_loss": r0["last_loss"]["torch_1f1b"],
        # each runtime's fastest schedule on this model and world, by median step
        "best_against_best": {
            "ours": ours_best.removeprefix("ours_"),
            "torch": torch_best.removeprefix("torch_"),
            "throughput_ratio_ours_vs_torch": step_s[torch_best] / step_s[ours_best],
        },
    }
    text = json.dumps(out, indent=2)
    print(text)
    name = (
        "results_schedules.json" if args.model == "gpt" else f"results_schedules_{args.model}.json"
    )
    (HERE / name).write_text(text + "\n")


if __name__ == "__main__":
    main()

"""Step overhead on the CPU: polytrain's real CLI step against a plain PyTorch loop (issue 36).

Question: what does polytrain add per step over the loop a careful user writes, on the same
model, where the step is launch-bound (a small GPT, one process, one thread, fp32, eager) and
every engineer can measure it? The result is the ratio polytrain / plain of the median step
time; the plain loop runs with torch's default AdamW (what polytrain's worker uses on the CPU),
``foreach=True`` and ``fused=True``, to show which optimizer the ratio is taken against.

Both sides read their step time the same way: ``polytrain train --nproc 1`` logs a metrics
record every ``log_every`` steps (`step_time_s`), the plain loop times windows of ``log_every``
steps; each side's figure is the median over the windows after the first two (warm-up).
Repetitions alternate which side runs first.

This module also holds what `benchmarks/gpu/main.py` shares with it: the polytrain CLI run
(`run_polytrain`, `window_median`) and the plain loop (`plain_windows`).

Run: python benchmarks/step_overhead/main.py [--reps 3] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WARMUP_WINDOWS = 2  # windows left out of every median: compilation, allocator, caches

# The launch-bound model: our gpt, small enough that the step is mostly per-op overhead.
MODEL = {
    "model.n_layer": 2,
    "model.n_embd": 64,
    "model.n_head": 4,
    "model.block_size": 64,
    "train.global_batch_size": 8,
}
OPTIMIZERS = ("default", "foreach", "fused")  # the plain loop's AdamW variants


def on_path() -> None:
    """This checkout's ``src`` and root importable (polytrain, ``benchmarks.*``) when run as a
    script from a copy of the repository where polytrain is not installed."""
    for p in (str(ROOT), str(ROOT / "src")):
        if p not in sys.path:
            sys.path.insert(0, p)


def worker_env(**extra: str) -> dict[str, str]:
    """The environment of a polytrain subprocess: this checkout first on the path."""
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path.rstrip(os.pathsep), **extra}


def toml_value(value: Any) -> str:
    """``value`` as the right-hand side of ``--set key=value`` (TOML)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


@dataclass
class PolytrainRun:
    """One ``polytrain train`` subprocess: its step time and MFU, or why it failed."""

    step_s: float | None = None
    mfu: float | None = None
    windows_s: list[float] = field(default_factory=list)
    compile: dict[str, Any] = field(default_factory=dict)  # any compile-time fields logged
    # Means of ``log_every`` consecutive steps from ``rank-0.json``'s per-step times (each the
    # strategy's step call): the plain loop's estimator; empty where no such list is written.
    step_windows_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    error: str = ""


def window_median(records: Sequence[dict[str, Any]], key: str) -> float | None:
    """Median of ``key`` over the logged records after the first `WARMUP_WINDOWS` (all of them
    when there are no more)."""
    values = [r[key] for r in records if r.get(key) is not None]
    kept = values[WARMUP_WINDOWS:] or values
    return statistics.median(kept) if kept else None


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def polytrain_command(
    fields: dict[str, Any], out_dir: Path, *, steps: int, log_every: int, extra: Sequence[str] = ()
) -> list[str]:
    """``python -m polytrain train --nproc 1 ...`` for ``fields`` (dotted job keys), logging
    every ``log_every`` steps to ``out_dir``, evaluating only at the end, no sample, no bar."""
    base = {
        "observe.out_dir": str(out_dir),
        "observe.log_every": log_every,
        "train.eval_every": 0,
        "train.eval_batches": 1,
        "train.sample_tokens": 0,
    }
    cmd = [sys.executable, "-m", "polytrain", "train", "--steps", str(steps), "--no-progress"]
    if not any(a == "--nproc" for a in extra):
        cmd += ["--nproc", "1"]
    for key, value in {**base, **fields}.items():
        cmd += ["--set", f"{key}={toml_value(value)}"]
    return [*cmd, *extra]


def run_polytrain(
    fields: dict[str, Any],
    out_dir: Path,
    *,
    steps: int,
    log_every: int,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout_s: float = 600.0,
) -> PolytrainRun:
    """Run polytrain's CLI as a user does and read its metrics records."""
    cmd = polytrain_command(fields, out_dir, steps=steps, log_every=log_every, extra=extra)
    t0 = time.perf_counter()
    # Its own session, so a timeout ends the launcher and its workers together.
    proc = subprocess.Popen(
        cmd,
        env=env or worker_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return PolytrainRun(wall_s=time.perf_counter() - t0, error=f"timed out ({timeout_s:.0f} s)")
    run = PolytrainRun(wall_s=time.perf_counter() - t0)
    if proc.returncode != 0:
        run.error = f"exit {proc.returncode}: {_last_line(stderr) or _last_line(stdout)}"
        return run
    path = out_dir / "metrics.jsonl"
    logged = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    run.compile = {k: v for r in logged for k, v in r.items() if "compile" in k}
    records = sorted((r for r in logged if "step_time_s" in r), key=lambda r: r["step"])
    run.windows_s = [r["step_time_s"] for r in records]
    run.step_s = window_median(records, "step_time_s")
    run.mfu = window_median(records, "mfu")
    summary = out_dir / "rank-0.json"
    per_step = json.loads(summary.read_text()).get("step_times_s", []) if summary.exists() else []
    run.step_windows_s = [
        statistics.fmean(per_step[i : i + log_every])
        for i in range(0, len(per_step) - log_every + 1, log_every)
    ]
    if run.step_s is None:
        run.error = f"no step_time_s in {path}"
    return run


def adamw(params: Any, kind: str) -> Any:
    """AdamW with polytrain's default hyper-parameters (`OptimConfig`); ``kind`` is torch's
    default implementation, ``foreach`` or ``fused``."""
    import torch

    from polytrain.config.job import OptimConfig

    cfg = OptimConfig()
    impl = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[kind]
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay, **impl
    )


def plain_windows(
    model: Any,
    loss_of: Callable[[Any, Any, Any], Any],
    batches: Sequence[tuple[Any, Any]],
    *,
    optimizer: str,
    dtype: str,
    windows: int,
    window_steps: int,
) -> list[float]:
    """The loop a careful user writes: autocast (bf16) forward, backward, clip at polytrain's
    ``grad_clip``, AdamW, ``zero_grad(set_to_none=True)``. Returns the mean step time of each
    window of ``window_steps`` steps; on CUDA the device is synchronised at the window ends
    only, so the host queues ahead as a plain loop lets it."""
    import torch

    from polytrain.config.job import OptimConfig

    clip = OptimConfig().grad_clip
    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    opt = adamw([p for p in model.parameters() if p.requires_grad], optimizer)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")
    times: list[float] = []
    step = 0
    for _ in range(windows):
        sync()
        t0 = time.perf_counter()
        for _ in range(window_steps):
            x, y = batches[step % len(batches)]
            step += 1
            with autocast:
                loss = loss_of(model, x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync()
        times.append((time.perf_counter() - t0) / window_steps)
    return times


def median_after_warmup(times: Sequence[float]) -> float:
    return statistics.median(times[WARMUP_WINDOWS:] or times)


def fastest_after_warmup(times: Sequence[float]) -> float:
    """The fastest window after warm-up: on a shared host, the one least slowed by others."""
    return min(times[WARMUP_WINDOWS:] or times)


def build_same_model(fields: dict[str, Any], device: str) -> tuple[Any, Any]:
    """The model polytrain builds for ``fields`` (same job, same `build_model`, same seed) on
    ``device``, and the data spec it was built for."""
    from polytrain.config.io import job_from_fields
    from polytrain.data.datasets import build_datasets
    from polytrain.models.registry import block_size_of, build_model

    job = job_from_fields(fields)
    _, _, spec = build_datasets(job.data, block_size_of(job.model))
    return build_model(job.model, spec, job.train.seed).to(device), spec


def random_batches(
    vocab: int, batch: int, block: int, device: str, n: int = 4
) -> list[tuple[Any, Any]]:
    """``n`` batches of random token ids (B, T) and their next-token targets, on ``device``."""
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, block + 1), generator=g)
        out.append((ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)))
    return out


def block_loss(model: Any, x: Any, y: Any) -> Any:
    """A `BlockModel`'s own loss (our gpt: cross-entropy over every position, in fp32)."""
    return model.loss(model(x), y)


def _plain(optimizer: str, steps: int, log_every: int) -> list[float]:
    model, spec = build_same_model(MODEL, "cpu")
    batches = random_batches(
        spec.vocab_size, MODEL["train.global_batch_size"], MODEL["model.block_size"], "cpu"
    )
    windows = max(steps // log_every, WARMUP_WINDOWS + 1)
    return plain_windows(
        model,
        block_loss,
        batches,
        optimizer=optimizer,
        dtype="fp32",
        windows=windows,
        window_steps=log_every,
    )


ESTIMATORS = ("median", "fastest")  # median of the logged windows; fastest window


def _summary(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5, help="repetitions, alternating the order")
    ap.add_argument("--steps", type=int, default=300, help="steps per run (both sides)")
    ap.add_argument("--log-every", type=int, default=10, help="window length in steps")
    ap.add_argument("--workdir", default="/tmp/polytrain-step-overhead")
    ap.add_argument("--out", default=str(HERE / "results.json"))
    args = ap.parse_args(argv)
    on_path()
    import torch

    torch.set_num_threads(1)
    env = worker_env(OMP_NUM_THREADS="1")
    workdir = Path(args.workdir) / time.strftime("%Y%m%d-%H%M%S")
    reps: list[dict[str, Any]] = []
    for rep in range(args.reps):
        row: dict[str, Any] = {"load_avg_1min": os.getloadavg()[0]}

        def ours(row: dict[str, Any] = row, rep: int = rep) -> None:
            run = run_polytrain(
                MODEL, workdir / f"rep{rep}", steps=args.steps, log_every=args.log_every, env=env
            )
            if run.error:
                raise SystemExit(f"polytrain failed: {run.error}")
            row["polytrain"] = {
                "median": run.step_s,
                "fastest": fastest_after_warmup(run.step_windows_s or run.windows_s),
                "records_s": run.windows_s,
                "step_windows_s": run.step_windows_s,
            }

        def plain(row: dict[str, Any] = row) -> None:
            for kind in OPTIMIZERS:
                times = _plain(kind, args.steps, args.log_every)
                row[f"plain_{kind}"] = {
                    "median": median_after_warmup(times),
                    "fastest": fastest_after_warmup(times),
                    "windows_s": times,
                }

        for part in (ours, plain) if rep % 2 == 0 else (plain, ours):
            part()
        row["ratio"] = {
            f"{est}_{kind}": row["polytrain"][est] / row[f"plain_{kind}"][est]
            for est in ESTIMATORS
            for kind in OPTIMIZERS
        }
        reps.append(row)
        print(
            f"rep {rep} (load {row['load_avg_1min']:.1f}): polytrain "
            f"{row['polytrain']['median'] * 1e3:.2f} ms, plain "
            + ", ".join(f"{k} {row[f'plain_{k}']['median'] * 1e3:.2f} ms" for k in OPTIMIZERS)
            + "; polytrain / plain "
            + ", ".join(f"{k} {row['ratio'][f'median_{k}']:.3f}" for k in OPTIMIZERS)
            + " (fastest windows: "
            + ", ".join(f"{k} {row['ratio'][f'fastest_{k}']:.3f}" for k in OPTIMIZERS)
            + ")",
            flush=True,
        )
    summary = {key: _summary([r["ratio"][key] for r in reps]) for key in reps[0]["ratio"]}
    for key, v in summary.items():
        est, kind = key.split("_")
        print(
            f"polytrain / plain ({kind} AdamW, {est} window): {v['median']:.3f} "
            f"({v['min']:.3f}-{v['max']:.3f} over {len(reps)} reps)"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "model": MODEL,
                "steps": args.steps,
                "log_every": args.log_every,
                "torch": torch.__version__,
                "cpu_count": os.cpu_count(),
                "load_avg_end": os.getloadavg(),
                "reps": reps,
                "summary": summary,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

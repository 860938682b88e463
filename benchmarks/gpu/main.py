"""One GPU: polytrain's real CLI step against a plain PyTorch loop on the same model (issue 36).

Question: on one GPU, how much slower is a step of ``polytrain train --nproc 1 --device cuda
--dtype bf16`` than the loop a careful user writes for the same model (bf16 autocast, AdamW
``fused=True``, clip 1.0, ``zero_grad(set_to_none=True)``, batches already on the device),
eager and under ``torch.compile``, and what MFU does each reach? Targets (issue 36): polytrain
/ plain <= 1.05 eager and compiled for every model; MFU >= 45% for the compiled GPT-2-medium
shape at batch 32 x 1024.

Models: our `gpt` in the GPT-2-small (12 x 768) and GPT-2-medium (24 x 1024) shapes at batch
16 x 512, the medium shape at 32 x 1024 (compiled only), and transformers' `GPT2LMHeadModel`
(12 x 768, n_positions 512) through polytrain's factory route (`gpt2` below, on the default
corpus's token ids). The plain loop builds the model from the same job fields with polytrain's
`build_model` (same dims, same seed) and its MFU comes from the function polytrain's loop uses
(`mfu`). polytrain's step time is the median of its metrics records' ``step_time_s`` after
the first two windows; the plain loop times windows of the same length, synchronising the
device at the window ends only.

``--strategies`` (on unless ``--no-strategies``): every strategy family's CUDA code path on
this one GPU, several ranks sharing it through gloo, a few steps each: pass, or the error line.

Run (GPU host): python benchmarks/gpu/main.py [--quick] [--only small,medium,medium-1024,hf]
Without CUDA it says so in one line and exits 2; ``--smoke-cpu`` checks the script on a CPU with
tiny models.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TARGET_RATIO = 1.05
TARGET_MFU = 0.45  # compiled GPT-2-medium shape at 32 x 1024
FACTORY = "benchmarks.gpu.main:gpt2"

GPT2_SMALL = {"model.n_layer": 12, "model.n_embd": 768, "model.n_head": 12}
GPT2_MEDIUM = {"model.n_layer": 24, "model.n_embd": 1024, "model.n_head": 16}
TINY = {"model.n_layer": 2, "model.n_embd": 64, "model.n_head": 2}  # --smoke-cpu

# Strategy families on one GPU (gloo, CUDA tensors): (name, CLI arguments).
STRATEGIES: list[tuple[str, list[str]]] = [
    ("dp2", ["--nproc", "2", "--dp", "2"]),
    ("zero2", ["--nproc", "2", "--zero", "2"]),
    ("zero3", ["--nproc", "2", "--zero", "3"]),
    ("tp2", ["--nproc", "2", "--tp", "2"]),
    ("gpipe", ["--nproc", "2", "--pp", "2", "--schedule", "gpipe", "--microbatches", "4"]),
    ("1f1b", ["--nproc", "2", "--pp", "2", "--schedule", "1f1b", "--microbatches", "4"]),
    ("pipedream", ["--nproc", "2", "--pp", "2", "--schedule", "pipedream", "--microbatches", "4"]),
    ("ps-sync", ["--nproc", "3", "--sync", "ps", "--ps-mode", "sync"]),
    ("gossip", ["--nproc", "2", "--sync", "gossip", "--topology", "ring"]),
    ("localsgd", ["--nproc", "2", "--sync", "localsgd", "--period", "2"]),
    ("dp2xtp2", ["--nproc", "4", "--dp", "2", "--tp", "2"]),
]


def gpt2(
    spec: Any, n_layer: int = 12, n_embd: int = 768, n_head: int = 12, n_positions: int = 512
) -> Any:
    """A user's model through polytrain's factory route: transformers' GPT-2 from a config,
    random weights, the data's vocabulary, no dropout, no key/value cache (training)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_positions=n_positions,
        vocab_size=spec.vocab_size,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


@dataclass(frozen=True)
class Case:
    name: str
    label: str
    fields: dict[str, Any]  # job fields (dotted keys), device and dtype included
    eager: bool = True  # False: compiled only
    hf: bool = False  # the transformers factory model

    @property
    def batch(self) -> int:
        return int(self.fields["train.global_batch_size"])

    @property
    def block(self) -> int:
        return int(self.fields["model.block_size"])

    def dim(self, name: str) -> int:
        """``n_layer`` / ``n_embd`` of the built-in's fields or the factory's arguments."""
        return int(self.fields.get(f"model.{name}") or self.fields["model.args"][name])


def cases(smoke: bool = False) -> list[Case]:
    run = (
        {"train.device": "cpu", "train.dtype": "fp32"}
        if smoke
        else {
            "train.device": "cuda",
            "train.dtype": "bf16",
        }
    )
    small, medium = (TINY, TINY) if smoke else (GPT2_SMALL, GPT2_MEDIUM)
    b, t, t_long = (4, 32, 64) if smoke else (16, 512, 1024)
    hf_dims = {k.split(".")[1]: v for k, v in small.items()}
    return [
        Case(
            "small",
            f"GPT-2-small shape {b}x{t}",
            {**run, **small, "model.block_size": t, "train.global_batch_size": b},
        ),
        Case(
            "medium",
            f"GPT-2-medium shape {b}x{t}",
            {**run, **medium, "model.block_size": t, "train.global_batch_size": b},
        ),
        Case(
            "medium-1024",
            f"GPT-2-medium shape {2 * b}x{t_long}",
            {**run, **medium, "model.block_size": t_long, "train.global_batch_size": 2 * b},
            eager=False,
        ),
        Case(
            "hf",
            f"transformers GPT2LMHeadModel {b}x{t}",
            {
                **run,
                "model.name": FACTORY,
                "model.args": {**hf_dims, "n_positions": t},
                "model.block_size": t,
                "train.global_batch_size": b,
            },
            hf=True,
        ),
    ]


def mfu(model: Any, tokens: int, samples: int, step_s: float, device: Any) -> float | None:
    """The MFU polytrain's loop would report for ``model`` at ``step_s`` (one device, bf16):
    the planner's FLOP count of the model (`measure.stats.stats_of` on a meta copy) over the
    catalog's dense peak (`measure.mfu.peak_flops`), as `measure.mfu.mfu_inputs` gives the
    loop."""
    import copy

    import torch

    from polytrain.measure.mfu import peak_flops
    from polytrain.measure.stats import stats_of

    peak = peak_flops(torch.device(device), "bf16")
    if not peak or not step_s:
        return None
    meta = copy.deepcopy(model).to("meta")
    ids = torch.zeros((2, tokens), dtype=torch.long, device="meta")
    return stats_of(meta, ids, ids).train_flops * samples / step_s / peak


def reference_mfu(case: Case, params: int, step_s: float, device: Any) -> float | None:
    """MFU from the textbook count, independent of polytrain's (PaLM, appendix B): 6 x
    parameters x tokens plus 12 x layers x width x tokens^2 per sample, over the same peak as
    `mfu`; where polytrain counts a model right, its MFU equals this one."""
    import torch

    from polytrain.measure.mfu import peak_flops

    peak = peak_flops(torch.device(device), "bf16")
    if not peak or not step_s:
        return None
    t = case.block
    flops = 6.0 * params * t + 12.0 * case.dim("n_layer") * case.dim("n_embd") * t * t
    return flops * case.batch / step_s / peak


def has_compile_flag() -> bool:
    """Whether this checkout's ``polytrain train`` takes ``--compile`` (``train.compile``)."""
    from benchmarks.step_overhead.main import worker_env

    proc = subprocess.run(
        [sys.executable, "-m", "polytrain", "train", "--help"],
        env=worker_env(COLUMNS="200"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    return re.search(r"(?<![\w-])--compile(?![\w-])", proc.stdout) is not None


def hf_loss(model: Any, x: Any, y: Any) -> Any:
    """What a transformers user writes: the logits' cross-entropy over every position, fp32."""
    import torch.nn.functional as F

    logits = model(x).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


@dataclass
class Budget:
    """The whole run's time limit; each part gets what is left."""

    seconds: float
    start: float = field(default_factory=time.perf_counter)

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)


def _plain(case: Case, compiled: bool, windows: int, window_steps: int) -> dict[str, Any]:
    import torch
    from benchmarks.step_overhead.main import (
        block_loss,
        build_same_model,
        median_after_warmup,
        plain_windows,
        random_batches,
    )

    device = case.fields["train.device"]
    built, spec = build_same_model(case.fields, device)
    module = built.blocks[0] if case.hf else built  # the user's own module, unwrapped
    run = torch.compile(module) if compiled else module
    batches = random_batches(spec.vocab_size, case.batch, case.block, device)
    optimizer = "fused" if device == "cuda" else "default"  # polytrain's CPU worker: default
    try:
        times = plain_windows(
            run,
            hf_loss if case.hf else block_loss,
            batches,
            optimizer=optimizer,
            dtype=case.fields["train.dtype"],
            windows=windows,
            window_steps=window_steps,
        )
        step_s = median_after_warmup(times)
        return {
            "step_s": step_s,
            "windows_s": times,
            "first_window_s": times[0] * window_steps,
            "mfu": mfu(built, case.block, case.batch, step_s, torch.device(device)),
            "optimizer": optimizer,
            "params": sum(p.numel() for p in built.parameters()),
        }
    finally:
        del built, module, run, batches
        gc.collect()
        torch._dynamo.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_case(
    case: Case, args: argparse.Namespace, compile_flag: bool, budget: Budget, workdir: Path
) -> dict[str, Any]:
    import torch
    from benchmarks.step_overhead.main import run_polytrain

    row: dict[str, Any] = {"case": case.name, "label": case.label, "fields": case.fields}
    if case.hf and importlib.util.find_spec("transformers") is None:
        row["skipped"] = "transformers not installed"
        print(f"  {case.name}: skipped: transformers not installed", flush=True)
        return row
    steps = 30 if args.quick else 40
    windows = 5 if args.quick else 7

    def ours(variant: str, extra: list[str]) -> None:
        if budget.left() < 30:
            row[f"polytrain_{variant}"] = {"error": "skipped: over the time budget"}
            return
        run = run_polytrain(
            case.fields,
            workdir / f"{case.name}-{variant}",
            steps=steps,
            log_every=10,
            extra=extra,
            timeout_s=budget.left(),
        )
        row[f"polytrain_{variant}"] = asdict(run)
        print(f"  {case.name} polytrain {variant}: {_ms(run.step_s)} {run.error}", flush=True)

    def plain(variant: str) -> None:
        if budget.left() < 20:
            row[f"plain_{variant}"] = {"error": "skipped: over the time budget"}
            return
        try:
            row[f"plain_{variant}"] = _plain(case, variant == "compiled", windows, 10)
        except Exception as exc:  # a failed variant is a result; the other cells go on
            row[f"plain_{variant}"] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        print(f"  {case.name} plain {variant}: {_ms(row[f'plain_{variant}'].get('step_s'))}")

    if case.eager:
        ours("eager", [])
        plain("eager")
    plain("compiled")
    if compile_flag:
        ours("compiled", ["--compile"])
    else:
        row["polytrain_compiled"] = {"error": "n/a: polytrain train has no --compile"}
    params = next((c["params"] for c in row.values() if isinstance(c, dict) and "params" in c), 0)
    device = torch.device(case.fields["train.device"])
    for variant in ("polytrain_eager", "plain_eager", "polytrain_compiled", "plain_compiled"):
        cell = row.get(variant, {})
        if params and cell.get("step_s"):
            cell["mfu_reference"] = reference_mfu(case, params, cell["step_s"], device)
    checks = [
        f"{v} {row[v]['mfu'] / row[v]['mfu_reference']:.2f}"
        for v in ("polytrain_eager", "polytrain_compiled", "plain_eager")
        if row.get(v, {}).get("mfu") and row[v].get("mfu_reference")
    ]
    if checks:
        print(f"  {case.name} MFU reported / 6NT + 12LdT^2: {', '.join(checks)}", flush=True)
    return row


def run_strategies(smoke: bool, budget: Budget, workdir: Path) -> list[dict[str, Any]]:
    from benchmarks.step_overhead.main import run_polytrain

    fields = {
        "train.device": "cpu" if smoke else "cuda",
        "launch.backend": "gloo",
        "train.global_batch_size": 16,
    }
    out = []
    for name, extra in STRATEGIES:
        if budget.left() < 25:
            out.append({"strategy": name, "args": extra, "ok": False, "error": "skipped: time"})
            continue
        run = run_polytrain(
            fields,
            workdir / f"strategy-{name}",
            steps=4,
            log_every=1,
            extra=extra,
            timeout_s=min(120.0, budget.left()),
        )
        ok = not run.error
        out.append(
            {"strategy": name, "args": extra, "ok": ok, "error": run.error, "wall_s": run.wall_s}
        )
        print(f"  {name:10} {'pass' if ok else 'FAIL'} {run.error}", flush=True)
    return out


def _ms(s: float | None) -> str:
    return f"{s * 1e3:.1f} ms" if s else "n/a"


def _pct(x: float | None) -> str:
    return f"{100 * x:.0f}%" if x else "-"


def _ratio(row: dict[str, Any], variant: str) -> float | None:
    ours = row.get(f"polytrain_{variant}", {}).get("step_s")
    plain = row.get(f"plain_{variant}", {}).get("step_s")
    return ours / plain if ours and plain else None


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"| model | polytrain eager | plain eager | ratio (<= {TARGET_RATIO}) | polytrain compiled "
        f"| plain compiled | ratio (<= {TARGET_RATIO}) | MFU polytrain eager / plain eager / "
        "polytrain compiled / plain compiled |"
    )
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['label']} | skipped: {row['skipped']} | | | | | | |")
            continue
        cell = {
            k: row.get(k, {})
            for k in ("polytrain_eager", "plain_eager", "polytrain_compiled", "plain_compiled")
        }
        ratios = [_ratio(row, v) for v in ("eager", "compiled")]
        r = [f"{x:.2f}" + ("" if x <= TARGET_RATIO else " (miss)") if x else "n/a" for x in ratios]
        mfus = " / ".join(_pct(c.get("mfu")) for c in cell.values())
        lines.append(
            f"| {row['label']} | {_ms(cell['polytrain_eager'].get('step_s'))} "
            f"| {_ms(cell['plain_eager'].get('step_s'))} | {r[0]} "
            f"| {_ms(cell['polytrain_compiled'].get('step_s'))} "
            f"| {_ms(cell['plain_compiled'].get('step_s'))} | {r[1]} | {mfus} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated cases (default: all)")
    ap.add_argument("--quick", action="store_true", help="fewer steps and windows")
    ap.add_argument("--strategies", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--budget-s", type=float, default=480.0, help="time limit of the whole run")
    ap.add_argument("--workdir", default="/tmp/polytrain-gpu-bench")
    ap.add_argument("--out", default=str(HERE / "results.json"))
    ap.add_argument("--smoke-cpu", action="store_true", help="check the script on a CPU host")
    args = ap.parse_args(argv)
    import torch

    if not args.smoke_cpu and not torch.cuda.is_available():
        print("benchmarks/gpu/main.py: no CUDA device here; run it on a GPU host")
        return 2
    known = {c.name: c for c in cases(args.smoke_cpu)}
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"--only: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    if str(ROOT) not in sys.path:  # run as a script: ``benchmarks.*`` from this checkout
        sys.path.insert(0, str(ROOT))
    from benchmarks.step_overhead.main import on_path

    on_path()
    try:
        import polytrain.config.io  # noqa: F401  (its dependencies: typer, rich, tomli-w, ...)
    except ImportError as exc:
        print(f"benchmarks/gpu/main.py: polytrain does not import here ({exc}); install it")
        return 2
    if args.smoke_cpu:  # a shared CPU host: one thread, as the CPU benchmark runs
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"
    budget = Budget(args.budget_s)
    workdir = Path(args.workdir) / time.strftime("%Y%m%d-%H%M%S")
    gpu = "cpu (smoke)" if args.smoke_cpu else torch.cuda.get_device_name(0)
    compile_flag = has_compile_flag()
    print(f"{gpu}, torch {torch.__version__}; polytrain --compile: {compile_flag}", flush=True)
    result: dict[str, Any] = {
        "gpu": gpu,
        "torch": torch.__version__,
        "commit": _commit(),
        "polytrain_compile_flag": compile_flag,
        "quick": args.quick,
        "cases": [],
    }
    out = Path(args.out)

    def save() -> None:
        result["wall_s"] = time.perf_counter() - budget.start
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str))

    for name in names:
        result["cases"].append(run_case(known[name], args, compile_flag, budget, workdir))
        save()
    print(table(result["cases"]))
    for row in result["cases"]:
        if row["case"] == "medium-1024":
            print(
                f"MFU target >= {100 * TARGET_MFU:.0f}% ({row['label']}, compiled): polytrain "
                f"{_pct(row.get('polytrain_compiled', {}).get('mfu'))}, plain "
                f"{_pct(row.get('plain_compiled', {}).get('mfu'))}"
            )
    if args.strategies:
        print("strategies on one device (gloo, several ranks):", flush=True)
        result["strategies"] = run_strategies(args.smoke_cpu, budget, workdir)
    save()
    print(f"wrote {out} ({result['wall_s']:.0f} s)")
    return 0


def _commit() -> str:
    try:
        proc = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
        )
        return proc.stdout.strip()
    except OSError:
        return ""


if __name__ == "__main__":
    sys.exit(main())

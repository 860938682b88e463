"""Train a job on spawned gloo ranks and SIGKILL one of them mid-run, by pid.

The membership tests of the parameter servers (a dead async worker, a dead async leaf) share
this shape: start every rank with the library harness's entry point, wait until rank 0 has
logged ``after_steps`` steps, kill ``victim``, and collect every other rank's result.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
from pathlib import Path
from typing import Any

from polytrain.testing import scaled
from polytrain.testing.harness import _entry


def _train_rank(rank: int, world_size: int, job: Any) -> dict[str, Any]:
    from polytrain.trainer.loop import train

    result = train(job)
    return {"val_loss": result.val_loss, "steps": len(result.history)}


def train_and_kill(
    job: Any, world: int, victim: int, tmp_path: Path, after_steps: int
) -> tuple[dict[int, dict[str, Any]], int | None]:
    """Every surviving rank's ``{"val_loss", "steps"}``, and the victim's exit code.

    ``job.observe.out_dir`` must be set and ``observe.log_every = 1`` (its ``metrics.jsonl``
    tells when rank 0 has made ``after_steps`` steps)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_file = str(tmp_path / "rendezvous")
    args = [(_train_rank, r, world, init_file, 60.0, results, (job,)) for r in range(world)]
    procs = [ctx.Process(target=_entry, args=a, daemon=True) for a in args]
    for p in procs:
        p.start()
    try:
        metrics = Path(job.observe.out_dir) / "metrics.jsonl"
        deadline = time.monotonic() + scaled(90)
        while time.monotonic() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= after_steps:
                break
            time.sleep(0.05)
        assert procs[victim].pid is not None
        os.kill(procs[victim].pid, signal.SIGKILL)
        out: dict[int, Any] = {}
        while len(out) < world - 1:
            try:
                rank, ok, value = results.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                hung = sorted(set(range(world)) - {victim} - set(out))
                raise TimeoutError(f"ranks {hung} hung") from None
            assert ok, value
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return out, procs[victim].exitcode

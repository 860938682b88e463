"""Checkpoint cost: seconds and bytes of a save and a restore for the default job, against DCP.

Question: what does a checkpoint of ``polytrain train``'s default job (gpt tiny, AdamW, 2
workers, data parallel) cost, and what does our tensors-only format (safetensors + JSON
manifest, full tensors gathered by ``get_state_dict``, see trainer/checkpoint.py) cost over
torch's own ``dcp.save`` / ``dcp.load`` (FileSystemWriter: pickled ``.metadata``) on the same
state, processes and disk?

Run: python benchmarks/checkpoint/main.py [--reps 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _rank(rank: int, world: int, root: str, reps: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from polytrain.comm.collectives import barrier
    from polytrain.comm.init import init_distributed
    from polytrain.config import job_from_dict
    from polytrain.data.datasets import build_datasets
    from polytrain.data.sampler import Batches
    from polytrain.models.registry import block_size_of, build_model
    from polytrain.trainer.build import build_strategy
    from polytrain.trainer.checkpoint import Checkpointer
    from polytrain.trainer.manifest import step_dir, verify

    def job(async_save: bool) -> Any:
        return job_from_dict(
            {
                "checkpoint": {
                    "dir": f"{root}/ours-{async_save}",
                    "keep": 2,
                    "async_save": async_save,
                },
                "observe": {"progress": False},
            }
        )

    base = job(False)
    ctx = init_distributed(device="cpu", backend="gloo")
    train_set, val_set, spec = build_datasets(base.data, block_size_of(base.model))
    batches = Batches(train_set, val_set, base.train.global_batch_size, base.train.seed)
    model = build_model(base.model, spec, base.train.seed)
    strategy = build_strategy(base, ctx, model, batches)
    for step in range(2):  # optimizer state exists
        strategy.train_step(step)

    def timed(fn: Any) -> float:
        barrier()
        t0 = time.perf_counter()
        fn()
        barrier()
        return time.perf_counter() - t0

    out: dict[str, list[float]] = {k: [] for k in ("ours", "ours_async_block", "ours_restore")}
    out.update({"dcp": [], "dcp_restore": []})
    ours = Checkpointer(base, strategy, rank, world)
    ours_async = Checkpointer(job(True), strategy, rank, world)
    module, optim = strategy.modules[0], strategy.optimizer
    for rep in range(reps):  # interleaved, so machine load hits both alike
        out["ours"].append(timed(partial(ours.save, rep + 1)))
        out["ours_async_block"].append(timed(partial(ours_async.save, rep + 1)))
        ours_async.wait()
        out["ours_restore"].append(
            timed(lambda: Checkpointer(base, strategy, rank, world).restore())
        )
        path = f"{root}/dcp/{rep}"

        def dcp_save(path: str = path) -> None:
            model_sd, optim_sd = get_state_dict(module, optim)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

        def dcp_load(path: str = path) -> None:
            model_sd, optim_sd = get_state_dict(module, optim)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(
                module, optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )

        out["dcp"].append(timed(dcp_save))
        out["dcp_restore"].append(timed(dcp_load))
    ours.close()
    ours_async.close()
    if rank != 0:
        return {}
    manifest = verify(step_dir(base.checkpoint.dir, reps))
    dcp_dir = Path(f"{root}/dcp/{reps - 1}")
    return {
        "seconds": {k: statistics.median(v) for k, v in out.items()},
        "bytes": {
            "ours": sum(f["bytes"] for f in manifest.files.values()),
            "ours_manifest": (step_dir(base.checkpoint.dir, reps) / "manifest.json").stat().st_size,
            "dcp": sum(p.stat().st_size for p in dcp_dir.iterdir()),
        },
        "parameters": sum(p.numel() for p in model.parameters()),
        "strategy": strategy.name,
        "world": world,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default="", help="where to write (default: a temporary dir)")
    args = parser.parse_args()
    from polytrain.testing import run_distributed

    root = args.dir or tempfile.mkdtemp(prefix="polytrain-ckpt-bench-")
    try:
        result = run_distributed(_rank, 2, root, args.reps, timeout_s=600)[0]
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    s, b = result["seconds"], result["bytes"]
    result["ratios"] = {
        "save_time_ours_over_dcp": s["ours"] / s["dcp"],
        "async_blocking_over_sync": s["ours_async_block"] / s["ours"],
        "restore_time_ours_over_dcp": s["ours_restore"] / s["dcp_restore"],
        "bytes_ours_over_dcp": b["ours"] / b["dcp"],
    }
    text = json.dumps(result, indent=1)
    print(text)
    (HERE / "results.json").write_text(text + "\n")


if __name__ == "__main__":
    main()

"""Worker process entry point: ``python -m polytrain.trainer.worker JOB.toml``.

The elastic agent starts one of these per rank. The job file was validated and written by the
launcher; the worker reads it, trains, and prints the summary on rank 0. Exceptions are recorded
by torch elastic's ``record`` so the launcher can name the failing rank and its error.
"""

from __future__ import annotations

import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from polytrain.comm.init import shutdown
from polytrain.config.io import job_from_dict, load_job
from polytrain.trainer.loop import train

__all__ = ["main"]


@record
def main() -> None:
    job = job_from_dict(load_job(sys.argv[1]))
    try:
        result = train(job)
        if result.state_dict is not None and result.start_step >= result.steps:
            # Resumed (e.g. an elastic restart) after the last step: no loss to report.
            print(f"polytrain: resumed at step {result.start_step} = train.steps: nothing to do")
        elif result.state_dict is not None:  # rank 0
            accuracy = result.history[-1].get("val_accuracy") if result.history else None
            print(
                f"final loss {result.final_loss:.4f}, validation loss {result.val_loss:.4f}"
                + (f", validation accuracy {accuracy:.1%}" if accuracy is not None else "")
            )
            if result.sample:
                print("sample:\n" + result.sample)
            metrics = Path(job.observe.out_dir or ".") / "metrics.jsonl"
            if job.observe.out_dir and metrics.exists():
                print(f"metrics: {metrics}")
            if job.checkpoint.save_final:
                print(f"weights: {job.checkpoint.save_final}")
    finally:
        shutdown()


if __name__ == "__main__":
    main()

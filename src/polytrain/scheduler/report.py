"""What a simulation measured: per-job records, a JSON-able summary, and the JCT CDF plot.

Definitions (docs/scheduler.md "Metrics"): JCT = finish - submission; queueing delay =
first start - submission; p99 = nearest-rank 99th percentile; makespan = last finish - first
submission; utilisation = device-seconds held (restarts included) / (devices x makespan);
finish-time fairness ``rho`` (Themis, Mahajan et al., NSDI'20) = JCT / the JCT the job would
have alone on a 1/N share of the cluster, N the time-averaged number of active jobs over its
life (a job asking more than its share is slowed in proportion; rho > 1: worse than its share).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from polytrain.errors import ConfigError

__all__ = ["JobRecord", "Summary", "percentile", "plot_cdf", "summarize"]


@dataclass(frozen=True)
class JobRecord:
    id: str
    submitted: float
    devices: int
    model: str
    first_started: float
    finished: float
    jct: float
    queueing: float
    preemptions: int  # resizes included: each stops and restarts the job
    rho: float


@dataclass(frozen=True)
class Summary:
    policy: str
    jobs: int
    avg_jct_s: float
    p99_jct_s: float
    makespan_s: float
    avg_queueing_s: float
    utilisation: float
    avg_rho: float
    max_rho: float
    preemptions: int
    decisions: int
    wall_s: float

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of non-empty ``values``."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summarize(
    policy: str,
    records: Sequence[JobRecord],
    *,
    devices: int,
    busy_device_s: float,
    decisions: int,
    wall_s: float,
) -> Summary:
    jcts = [r.jct for r in records]
    makespan = max(r.finished for r in records) - min(r.submitted for r in records)
    n = len(records)
    return Summary(
        policy=policy,
        jobs=n,
        avg_jct_s=sum(jcts) / n,
        p99_jct_s=percentile(jcts, 99),
        makespan_s=makespan,
        avg_queueing_s=sum(r.queueing for r in records) / n,
        utilisation=busy_device_s / (devices * makespan) if makespan > 0 else 0.0,
        avg_rho=sum(r.rho for r in records) / n,
        max_rho=max(r.rho for r in records),
        preemptions=sum(r.preemptions for r in records),
        decisions=decisions,
        wall_s=wall_s,
    )


def plot_cdf(jcts: Mapping[str, Sequence[float]], png: str | Path, title: str = "") -> Path:
    """CDF of JCT per policy (log time axis) to ``png``; never overwrites an existing file."""
    out = Path(png)
    if out.exists():
        raise ConfigError(f"--cdf {str(out)!r} already exists: choose another path or remove it")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in jcts.items():
        ordered = sorted(v / 3600 for v in values)
        ys = [(i + 1) / len(ordered) for i in range(len(ordered))]
        ax.step(ordered, ys, where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (hours, log scale)")
    ax.set_ylabel("fraction of jobs")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=120)
        try:
            os.link(tmp, out)  # atomic, and fails rather than replace a file made meanwhile
        except FileExistsError:
            raise ConfigError(
                f"--cdf {str(out)!r} already exists: choose another path or remove it"
            ) from None
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return out

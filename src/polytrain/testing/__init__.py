"""Shipped test helpers: a multi-process gloo harness, a parity check (STYLE 6, 7), and
deadlines that scale with the machine's measured speed."""

from polytrain.testing.harness import RankFailure, run_distributed
from polytrain.testing.jobs import run_job
from polytrain.testing.parity import assert_state_close, max_abs_diff
from polytrain.testing.speed import scaled, slowdown

__all__ = [
    "RankFailure",
    "assert_state_close",
    "max_abs_diff",
    "run_distributed",
    "run_job",
    "scaled",
    "slowdown",
]

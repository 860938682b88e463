"""Shipped test helpers: a multi-process gloo harness and a parity check (STYLE 6, 7)."""

from polytrain.testing.harness import RankFailure, run_distributed
from polytrain.testing.jobs import run_job
from polytrain.testing.parity import assert_state_close, max_abs_diff

__all__ = ["RankFailure", "assert_state_close", "max_abs_diff", "run_distributed", "run_job"]

"""Through the ``polytrain`` command: asynchronous gossip neither waits for a slow worker nor
stops when one is SIGKILLed.

One run, world 3 (a ring: every rank is every other's neighbour): rank 2 sleeps
``gossip.straggler_delay_s`` every step; once rank 0 has logged step 5, rank 2 is SIGKILLed. The
run must exit 0 after the last step, say which worker left and when (the survivors' line with
the time, in their logs, and the dead rank's last step; the launcher's line on stderr with the
time), and rank 0's steps must not
have waited for the slow rank while it lived. See [Note: asynchronous mailboxes] in
comm/gossip_async.py and [Note: no world collectives in async gossip] in gossip/asynchronous.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from polytrain.comm.gossip_async import _step_of, with_step
from polytrain.config import job_from_dict
from polytrain.gossip.family import DECENTRALIZED
from tests.helpers.cli_runs import last_step, train_and_signal

STEPS = 150
DELAY_S = 0.3  # rank 2 would need 45 s for the run: it is killed long before


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_message_carries_its_step_exactly(dtype: torch.dtype) -> None:
    payload = torch.randn(5).to(dtype)
    for step in (0, 257, 70_001, -1):
        message = with_step(payload, step)
        assert _step_of(message) == step
        assert torch.equal(message[:5], payload)


def test_async_gossip_tolerates_every_rank_but_0() -> None:
    def job(mode: str) -> list[int]:
        return DECENTRALIZED.tolerated_ranks(
            job_from_dict(
                {
                    "parallel": {"sync": "gossip"},
                    "gossip": {"mode": mode},
                    "launch": {"nproc": 4},
                    "train": {"global_batch_size": 8},
                }
            )
        )

    assert job("async") == [1, 2, 3]
    assert job("sync") == []


@pytest.mark.slow
def test_async_gossip_survives_a_killed_worker(tmp_path: Path) -> None:
    out = tmp_path / "run"
    metrics = out / "metrics.jsonl"
    run = train_and_signal(
        [
            *("--model", "mlp", "--sync", "gossip", "--nproc", "3", "--topology", "ring"),
            *("--steps", str(STEPS), "--batch-size", "12", "--no-progress"),
            *("--out-dir", str(out), "--set", "observe.log_every=1"),
            *("--set", "gossip.mode=async", "--set", f"gossip.straggler_delay_s={DELAY_S}"),
        ],
        tmp_path,
        metrics,
        rank=2,
        end_timeout_s=80,  # it ends in seconds; a hang reports its logs before pytest's timeout
    )
    stdout, stderr, killed_at = run.stdout, run.stderr, run.signalled_at_step
    assert killed_at < STEPS - 20
    assert run.returncode == 0, stderr
    assert last_step(metrics) == STEPS
    assert "final loss" in stdout
    # The launcher names the rank and the time; the survivors, in their logs, how far it got.
    died = r"polytrain: worker rank 2 died \(SIGKILL\) [\d.]+ s into the run; training continues"
    assert len(re.findall(died, stderr)) == 1, stderr
    logs = "".join(
        p.read_text() for p in sorted((out / "logs").glob("*/attempt_0/[01]/stderr.log"))
    )
    left = re.findall(
        r"polytrain: worker rank 2 left ([\d.]+) s into training \((?:its last copy was of step "
        r"(\d+)|never heard); noticed by rank ([01]) at step (\d+)\)",
        logs,
    )
    assert left, logs
    for _, last_copy, _, noticed in left:
        assert int(noticed) <= STEPS
        assert not last_copy or int(last_copy) < STEPS
    # While rank 2 lived, rank 0 did not wait for it: its steps took far less than rank 2's.
    summary = json.loads((out / "rank-0.json").read_text())
    early = sorted(summary["step_times_s"][: max(killed_at, 1)])
    assert early[len(early) // 2] < DELAY_S / 2, early

"""An elastic agent that lets some worker ranks die without stopping the others.

[Note: tolerated worker deaths] In parameter-server ``async``/``ssp`` mode the servers drop a
dead worker and training goes on without it (docs/parameter_server.md, "Membership"). torch's
elastic agent would not let it: ``LocalElasticAgent._monitor_workers`` polls the process context
(``PContext.wait(0)``), and ``SubprocessContext._poll`` closes every worker as soon as any one
exits non-zero; ``SimpleElasticAgent._invoke_run`` then restarts or fails the whole group
(torch/distributed/elastic/agent/server/local_elastic_agent.py and api.py, torch 2.13).

``TolerantAgent`` replaces torch's worker check (`polytrain._torch_private.MonitoredAgent.monitor`,
our door to ``_monitor_workers``, which also shortens the shutdown grace), and polytrain runs every job
under it (with no tolerated ranks outside PS async/ssp). It polls the worker processes itself
(``proc.poll()`` on the context's ``subprocess_handlers``) instead of calling ``wait(0)``, whose
close of the group waits torch's fixed 30 s before it SIGKILLs a process that ignores SIGTERM
(a stopped one); shutdown uses the launcher's short grace ([Note: stopped ranks]):

- a rank in ``tolerated`` that exits non-zero is reported once, as one line on stderr with the
  seconds since the round's workers started, and ignored from then on;
- any other rank that exits non-zero makes the group ``FAILED`` with that failure, exactly as
  torch would report it, so the agent stops the others and fails (or restarts, with
  ``max_restarts``) as before; a restart starts a new process context, which forgets the
  tolerated deaths of the previous round;
- when every process has exited and no intolerable one failed, the group ``SUCCEEDED``;
- when every intolerable rank (rank 0 and the servers) has exited with success, the job is
  done; a tolerated rank still running ``DROPPED_GRACE_S`` later is a worker the servers dropped
  (hung, SIGSTOPped, sleeping: silent past ``ps.worker_timeout_s``). It can never finish, so it
  is SIGKILLed with one line naming it. In asynchronous gossip (every rank but 0 tolerated,
  [Note: no world collectives in async gossip] in polytrain.gossip.asynchronous) the exported
  weights are rank 0's replica, so a straggler still running then is ended the same way. Before, the agent reported the group healthy while any
  process lived, and ``polytrain train`` waited forever.

``launch_tolerant`` is the part of torch's ``torch.distributed.launcher.api.launch_agent`` that
builds the agent, with ``TolerantAgent`` in place of ``LocalElasticAgent`` (no health-check
server, metrics or events, which polytrain does not configure). Not done in tolerant mode:
torch's opt-in check for workers stuck in uninterruptible sleep
(``TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT``, off unless that variable is set).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Collection
from typing import Any

from torch.distributed.elastic import rendezvous
from torch.distributed.elastic.agent.server.api import (
    RunResult,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.multiprocessing.api import (
    PContext,
    SignalException,
    SubprocessContext,
)
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
from torch.distributed.launcher.api import LaunchConfig

from polytrain._torch_private import MonitoredAgent

__all__ = ["DROPPED_GRACE_S", "TolerantAgent", "launch_tolerant"]

DROPPED_GRACE_S = 10.0  # a healthy worker exits well within this once the servers are done


def _how(failure: ProcessFailure) -> str:
    if failure.exitcode < 0 and failure.signal_name() != "<N/A>":
        return failure.signal_name()
    return f"exit code {failure.exitcode}"


def _sees_every_rank(worker_group: WorkerGroup) -> bool:
    """Whether this node runs the whole job, so it sees rank 0 and the servers exit.

    Another node's agent of a multi-node job cannot tell that the job is done; it leaves its
    lingering workers alone."""
    workers = worker_group.workers
    return bool(workers) and all(w.world_size == len(workers) for w in workers)


class TolerantAgent(MonitoredAgent):
    """``LocalElasticAgent`` that keeps the group running when a ``tolerated`` rank dies."""

    def __init__(self, *args: Any, tolerated: Collection[int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tolerated = frozenset(tolerated)
        self._round: PContext | None = None
        self._dead: dict[int, ProcessFailure] = {}  # global rank -> its failure, this round
        self._done_at: float | None = None  # when every intolerable rank had exited with 0
        self._started = time.monotonic()  # when this round's workers were first seen

    def monitor(self, worker_group: WorkerGroup, pc: PContext | None) -> RunResult:
        if not isinstance(pc, SubprocessContext):
            return super().monitor(worker_group, pc)
        if pc is not self._round:  # a new round (first start or restart)
            self._round, self._dead, self._done_at = pc, {}, None
            self._started = time.monotonic()
        failures: dict[int, ProcessFailure] = {}
        running = 0
        lingering: dict[int, tuple[int, Any]] = {}  # tolerated, running: rank -> local, handler
        for local_rank, handler in pc.subprocess_handlers.items():
            rank = worker_group.workers[local_rank].global_rank
            code = handler.proc.poll()
            if code is None:
                running += 1
                if rank in self.tolerated:
                    lingering[rank] = (local_rank, handler)
            elif code != 0 and rank not in self._dead:
                failure = ProcessFailure(
                    local_rank=local_rank,
                    pid=handler.proc.pid,
                    exitcode=code,
                    error_file=pc.error_files[local_rank],
                )
                if rank in self.tolerated:
                    self._dead[rank] = failure
                    print(
                        f"polytrain: worker rank {rank} died ({_how(failure)}) "
                        f"{time.monotonic() - self._started:.1f} s into the run; "
                        "training continues with the others",
                        file=sys.stderr,
                        flush=True,
                    )
                else:
                    failures[rank] = failure
        if failures:
            return RunResult(state=WorkerState.FAILED, failures=failures)
        if running and running == len(lingering) and _sees_every_rank(worker_group):
            self._end_dropped(lingering)  # rank 0 and the servers succeeded: the job is done
        if running:
            return RunResult(state=WorkerState.HEALTHY)
        # Every rank needs an entry: torch's event recording looks each worker up here.
        done = {w.global_rank: None for w in worker_group.workers}
        return RunResult(state=WorkerState.SUCCEEDED, return_values=done)

    def _end_dropped(self, lingering: dict[int, tuple[int, Any]]) -> None:
        now = time.monotonic()
        if self._done_at is None:
            self._done_at = now
            return
        if now - self._done_at < DROPPED_GRACE_S:
            return
        for rank, (local_rank, handler) in sorted(lingering.items()):
            handler.proc.kill()
            handler.proc.wait()
            self._dead[rank] = ProcessFailure(
                local_rank=local_rank, pid=handler.proc.pid, exitcode=-9, error_file=""
            )
            print(
                f"polytrain: worker rank {rank} was still running {DROPPED_GRACE_S:.0f} s "
                "after rank 0 and any servers finished (hung, stopped or too slow to matter: "
                "the result is rank 0's and the servers'); ended it with SIGKILL",
                file=sys.stderr,
                flush=True,
            )


def launch_tolerant(
    config: LaunchConfig,
    entrypoint: str,
    args: list[str],
    tolerated: Collection[int],
    *,
    grace_s: int = 30,
) -> None:
    """Run ``entrypoint args`` under a ``TolerantAgent``; raise ``ChildFailedError`` on failure.
    ``grace_s``: seconds between SIGTERM and SIGKILL when workers are stopped."""
    params = rendezvous.RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=get_rendezvous_handler(params),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        local_addr=config.local_addr,
    )
    assert config.logs_specs is not None
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    agent = TolerantAgent(
        spec=spec,
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=grace_s,
        tolerated=tolerated,
    )
    shutdown_rdzv = True
    try:
        result = agent.run()
        if result.is_failed():
            raise ChildFailedError(name=entrypoint, failures=result.failures)
    except SignalException:
        shutdown_rdzv = False  # as torch: keep the rendezvous open for the other nodes
        raise
    finally:
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()

"""Every process group polytrain makes fails within the job's timeout ([Note: group timeouts]).

torch gives a group made after start-up its own 30-minute default; a collective on it with a
peer gone then hangs the run (found on the emulated two-host cluster: the hierarchical hook's
leaders' all-reduce outlived a cut link by minutes).
"""

from __future__ import annotations

import time

import pytest

from polytrain.testing import run_distributed

pytestmark = pytest.mark.slow

JOB_TIMEOUT_S = 2.0


def _lonely_collectives(rank: int, world: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from polytrain._torch_private import default_store
    from polytrain.comm.init import init_distributed, new_group
    from polytrain.comm.mesh import build_mesh
    from polytrain.topology import ParallelDims

    init_distributed(timeout_s=JOB_TIMEOUT_S)  # the harness's group stays; the timeout is the job's
    group = new_group([0, 1])
    mesh = build_mesh(ParallelDims(dp=1, tp=2))
    store = default_store()
    assert store is not None
    seconds: dict[str, float] = {}
    if rank == 0:  # rank 1 never joins these collectives
        for name, pg in (("new_group", group), ("mesh tp", mesh.group("tp"))):
            start = time.monotonic()
            with pytest.raises(RuntimeError, match="(?i)timed out"):
                dist.all_reduce(torch.ones(1), group=pg)
            seconds[name] = time.monotonic() - start
        store.set("rank0/done", "1")
    else:
        store.wait(["rank0/done"])
    return seconds


def test_groups_and_mesh_dimensions_time_out_with_the_job() -> None:
    """The lonely collective fails (it would otherwise wait 30 minutes, past the harness's
    deadline); the world group's own timeout is 60 s, so this is the job's timeout at work."""
    seconds = run_distributed(_lonely_collectives, 2, timeout_s=90, collective_timeout_s=60)[0]
    assert set(seconds) == {"new_group", "mesh tp"}
    assert all(s < 55 for s in seconds.values()), seconds  # not the world group's 60 s either

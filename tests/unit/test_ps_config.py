"""Parameter-server mistakes caught before launch (no processes)."""

from __future__ import annotations

import pytest

from polytrain.errors import ConfigError
from tests.conftest import small_job


def test_ps_errors_before_launch() -> None:
    with pytest.raises(ConfigError, match="ps.servers = 2 leaves no worker among 2 ranks"):
        small_job(parallel={"sync": "ps"}, ps={"servers": 2}, launch={"nproc": 2})
    with pytest.raises(ConfigError, match="ps.staleness = -1: expected a non-negative"):
        small_job(parallel={"sync": "ps"}, ps={"mode": "ssp", "staleness": -1})
    with pytest.raises(ConfigError, match="ps.staleness = 3 has no effect with ps.mode = 'async'"):
        small_job(parallel={"sync": "ps"}, ps={"mode": "async", "staleness": 3})
    with pytest.raises(ConfigError, match="ps.spare_workers = 1: joining workers need"):
        small_job(parallel={"sync": "ps"}, ps={"spare_workers": 1}, launch={"nproc": 3})
    with pytest.raises(ConfigError, match="leaves no worker to start the job"):
        small_job(
            parallel={"sync": "ps"},
            ps={"mode": "async", "spare_workers": 1},
            launch={"nproc": 2},
        )


def test_hogwild_across_hosts_is_an_error() -> None:
    from polytrain.ps.hogwild import HogwildConfig

    with pytest.raises(ConfigError, match="hogwild.nnodes = 2: .* exactly 1 node"):
        HogwildConfig(nnodes=2)
    with pytest.raises(ConfigError, match="hogwild.nonzeros = 9 exceeds"):
        HogwildConfig(features=8, nonzeros=9)


def test_preflight_rejects_what_ps_cannot_run() -> None:
    from polytrain.trainer.preflight import preflight

    with pytest.raises(ConfigError, match="ps.servers = 8 exceeds the 7 parameters"):
        preflight(small_job(parallel={"sync": "ps"}, ps={"servers": 8}, launch={"nproc": 9}))
    with pytest.raises(ConfigError, match="with tp = 2, pp = 1: parameter-server workers"):
        preflight(small_job(parallel={"sync": "ps", "tp": 2}, launch={"nproc": 5}))
    with pytest.raises(ConfigError, match="ps.mode = 'async': only ps.mode = 'sync' parameter"):
        preflight(
            small_job(
                parallel={"sync": "ps"},
                ps={"mode": "async"},
                checkpoint={"dir": "ck"},
                launch={"nproc": 3},
            )
        )
    preflight(small_job(parallel={"sync": "ps"}, checkpoint={"dir": "ck"}, launch={"nproc": 3}))
    preflight(small_job(parallel={"sync": "ps"}, launch={"nproc": 3}))


def test_colocated_servers_config() -> None:
    """[Note: colocated servers]: sync only, no host reduction, at most one server per rank;
    a valid job needs no extra ranks and may be checkpointed ([Note: colocated
    checkpoints])."""
    from polytrain.ps.checks import checkpoint_refusal
    from polytrain.trainer.preflight import preflight

    ps = {"sync": "ps"}
    with pytest.raises(ConfigError, match="ps.colocate = true with ps.mode = 'async'"):
        small_job(parallel=ps, ps={"colocate": True, "mode": "async"}, launch={"nproc": 2})
    with pytest.raises(ConfigError, match="hierarchical = True: colocated servers run in sync"):
        small_job(parallel=ps, ps={"colocate": True, "hierarchical": True}, launch={"nproc": 2})
    with pytest.raises(ConfigError, match="ps.servers = 3 with ps.colocate = true: .* at most 2"):
        small_job(parallel=ps, ps={"colocate": True, "servers": 3}, launch={"nproc": 2})
    job = small_job(parallel=ps, ps={"colocate": True, "servers": 2}, launch={"nproc": 2})
    assert job.num_trainers == 2 and job.parallel.dp == 2
    preflight(job)
    saved = small_job(
        parallel=ps,
        ps={"colocate": True, "servers": 2},
        checkpoint={"dir": "ck"},
        launch={"nproc": 2},
    )
    assert checkpoint_refusal(saved) == ""
    preflight(saved)


def test_leaf_server_config() -> None:
    """ps.leaves: 'host' or a group size that divides the workers, parameter servers only."""
    ps = {"sync": "ps"}
    job = small_job(parallel=ps, ps={"leaves": 2}, launch={"nproc": 5})
    assert job.ps.leaves == 2 and job.num_trainers == 4
    assert small_job(parallel=ps, ps={"leaves": "host"}, launch={"nproc": 3}).ps.leaves == "host"
    with pytest.raises(ConfigError, match="ps.leaves = 3 does not divide the 4 workers"):
        small_job(parallel=ps, ps={"leaves": 3}, launch={"nproc": 5})
    with pytest.raises(ConfigError, match="ps.leaves = 2 with parallel.sync = 'allreduce'"):
        small_job(ps={"leaves": 2}, launch={"nproc": 4})
    with pytest.raises(ConfigError, match="ps.leaves = -1: expected 'host'"):
        small_job(parallel=ps, ps={"leaves": -1}, launch={"nproc": 3})
    with pytest.raises(
        ConfigError, match="ps.leaves = 'rack' has the wrong type: expected int or 'host'"
    ):
        small_job(parallel=ps, ps={"leaves": "rack"}, launch={"nproc": 3})
    for other in ({"colocate": True}, {"hierarchical": True}):
        with pytest.raises(ConfigError, match="leaf servers replace the per-host reduction"):
            small_job(parallel=ps, ps={"leaves": 2, **other}, launch={"nproc": 3})


def test_leaf_groups_and_sizes() -> None:
    from polytrain.ps.leaf import leaf_groups, leaf_size

    assert leaf_groups([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert leaf_groups([0, 1, 2], 2) == [[0, 1], [2]]  # hosts may be unequal
    ps, launch = {"sync": "ps"}, {"nproc": 3}
    host = small_job(parallel=ps, ps={"leaves": "host", "ranks_per_host": 2}, launch=launch)
    assert leaf_size(host) == 2
    assert leaf_size(small_job(parallel=ps, ps={"leaves": 0}, launch=launch)) == 0

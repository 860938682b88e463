"""Each strategy family's registry row against the code that reads it: the planner prices a
family with the cost model its row names, its flags are fields of its own sections, and the
ranks it lets die are what its runtime survives (tested end to end in tests/integration)."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any

import pytest

from polytrain.cli.train import FLAG_FIELDS
from polytrain.config.base import describe_field, to_dict
from polytrain.config.io import job_from_dict, merge
from polytrain.config.job import JobConfig
from polytrain.errors import CheckpointError
from polytrain.gossip.family import DECENTRALIZED
from polytrain.planner.cost.hybrid import step_model
from polytrain.planner.types import Layout
from polytrain.trainer.build import FAMILIES, strategy_family
from polytrain.trainer.resume_checks import check_state_carries_over

# One layout of every family (and of each ``sync`` a family runs).
LAYOUTS = [
    Layout(dp=2),
    Layout(dp=2, tp=2, zero=3),
    Layout(pp=2, microbatches=4),
    Layout(dp=2, pp=2, microbatches=2),
    Layout(dp=3, sync="ps", ps_servers=1, ps_mode="async"),
    Layout(dp=4, sync="gossip", topology="ring"),
    Layout(dp=4, sync="localsgd", period=4),
]


def _job(layout: Layout) -> JobConfig:
    data: dict[str, Any] = {"train": {"global_batch_size": 24}}
    for path, value in layout.overrides().items():
        merge(data, path.split("."), value)
    return job_from_dict(data)


@pytest.mark.parametrize("layout", LAYOUTS, ids=Layout.describe)
def test_the_planner_prices_a_layout_with_its_familys_cost_model(layout: Layout) -> None:
    family = strategy_family(_job(layout))
    assert family.cost_model.startswith("polytrain.planner.cost.")
    importlib.import_module(family.cost_model)
    assert step_model(layout).__module__ == family.cost_model, family.name


def test_every_family_is_priced() -> None:
    priced = {strategy_family(_job(layout)).name for layout in LAYOUTS}
    assert priced == {family.name for family in FAMILIES}


def test_family_flags_are_fields_of_their_own_sections() -> None:
    seen: dict[str, str] = {}
    for family in FAMILIES:
        for flag, path in family.flags.items():
            assert path.split(".")[0] in family.sections, f"{family.name}: --{flag} -> {path}"
            describe_field(JobConfig, path)  # raises for a field that does not exist
            assert flag not in seen, f"--{flag} declared by {family.name} and {seen[flag]}"
            seen[flag] = family.name
            assert FLAG_FIELDS[flag] == path  # `polytrain train` offers it


def test_only_asynchronous_families_let_ranks_die() -> None:
    for layout in LAYOUTS:
        job = _job(layout)
        tolerated = strategy_family(job).tolerated_ranks(job)
        if layout.sync == "ps" and layout.ps_mode == "async":
            assert tolerated == [1, 2]  # workers 0-2, server 3: rank 0 and the server are needed
        else:
            assert tolerated == [], layout.describe()
    job = job_from_dict(
        {"parallel": {"sync": "gossip"}, "gossip": {"mode": "async"}, "launch": {"nproc": 4}}
    )
    assert DECENTRALIZED.tolerated_ranks(job) == [1, 2, 3]


def _localsgd(outer: str) -> JobConfig:
    return job_from_dict(
        {"parallel": {"sync": "localsgd"}, "localsgd": {"outer": outer}, "launch": {"nproc": 2}}
    )


def test_state_settings_are_fields_the_family_owns() -> None:
    for family in FAMILIES:
        for path in family.state_settings:
            assert path.split(".")[0] in family.sections, f"{family.name}: {path}"
            describe_field(JobConfig, path)  # raises for a field that does not exist


def test_a_resume_compares_the_settings_a_family_row_declares(tmp_path: Path) -> None:
    """The checkpoint refuses a change of what the job's family row declares, and only that:
    a toy family declaring ``train.seed`` is refused on a new seed and not on a new
    ``localsgd.outer`` (the setting the decentralized row declares)."""
    toy = dataclasses.replace(
        DECENTRALIZED, name="toy", selects=lambda job: True, state_settings={"train.seed": "X"}
    )
    seed1 = to_dict(job_from_dict({"train": {"seed": 1}}))
    with pytest.raises(
        CheckpointError,
        match=r"saved with train.seed = 1 and this job has 2: X cannot carry over; "
        r"resume with --set train.seed=1 or start from another --checkpoint-dir",
    ):
        check_state_carries_over(
            seed1, "toy", job_from_dict({"train": {"seed": 2}}), tmp_path, (toy,)
        )
    check_state_carries_over(
        to_dict(_localsgd("nesterov")), "toy", _localsgd("none"), tmp_path, (toy,)
    )


def test_the_decentralized_row_guards_diloco_state(tmp_path: Path) -> None:
    """With the real table: DiLoCo's outer step may not be dropped, added, or left behind by a
    resume under another family (whose jobs count as the setting's default, 'none')."""
    nesterov = to_dict(_localsgd("nesterov"))
    for saved, family, job in [
        (nesterov, "decentralized", _localsgd("none")),
        (to_dict(_localsgd("none")), "decentralized", _localsgd("nesterov")),
        (nesterov, "decentralized", job_from_dict({"launch": {"nproc": 2}})),
    ]:
        with pytest.raises(CheckpointError, match=r"localsgd.outer = .*--set localsgd.outer="):
            check_state_carries_over(saved, family, job, tmp_path)
    check_state_carries_over(nesterov, "decentralized", _localsgd("nesterov"), tmp_path)
    check_state_carries_over(nesterov, None, _localsgd("nesterov"), tmp_path)  # older manifest

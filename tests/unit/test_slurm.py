"""The Slurm backend without Slurm: placement on nodes, the generated script, job records read
back (real ``scontrol -o show job`` samples), and ``polytrain sched slurm-script``'s bad inputs."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from polytrain.errors import ConfigError
from polytrain.scheduler.backend import Launch
from polytrain.scheduler.slurm import SlurmBackend, exit_code, nodes_for, parse_job_records
from polytrain.scheduler.slurm_script import ScriptSpec, batch_script
from tests.helpers.cli import assert_usage_error, run_main

SAMPLES = Path(__file__).parent / "data" / "scontrol_show_job.txt"


def samples() -> dict[str, dict[str, str]]:
    """Case name -> the parsed record captured under ``## <CASE>``."""
    out: dict[str, dict[str, str]] = {}
    case = ""
    for line in SAMPLES.read_text().splitlines():
        if line.startswith("## "):
            case = line.split()[1]
        elif line.startswith("JobId="):
            (record,) = parse_job_records(line).values()
            out[case] = record
    return out


# -- placement on nodes -------------------------------------------------------------------------

NODES = ("n1", "n2", "n3")


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        ((0,), (("n1",), 1)),
        ((1, 2), (("n1", "n2"), 1)),  # one slot on each side of a node boundary
        ((2, 3), (("n2",), 2)),
        ((0, 1, 2, 3), (("n1", "n2"), 2)),
        ((1, 3, 5), (("n1", "n2", "n3"), 1)),
    ],
)
def test_slots_map_to_nodes_and_workers_per_node(
    devices: tuple[int, ...], expected: tuple[tuple[str, ...], int]
) -> None:
    assert nodes_for(devices, NODES, 2) == expected


def test_unequal_workers_per_node_are_refused_naming_the_counts() -> None:
    with pytest.raises(ConfigError, match=r"unequal worker counts on its nodes \(n1: 2, n2: 1\)"):
        nodes_for((0, 1, 2), NODES, 2)


def test_a_slot_off_the_cluster_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"slot 6 is not on this cluster .*slots 0\.\.5"):
        nodes_for((6,), NODES, 2)


# -- the generated script -----------------------------------------------------------------------


def launch(tmp_path: Path, devices: tuple[int, ...], resume: bool) -> Launch:
    return Launch(
        job_id="job-7",
        config=tmp_path / "my job.toml",  # a space: every path must reach the nodes quoted
        devices=devices,
        run_dir=tmp_path / "runs" / "job-7-1",
        checkpoint_dir=tmp_path / "ckpt",
        checkpoint_every=10,
        resume=resume,
        log=tmp_path / "logs" / "job-7-1.log",
    )


def sbatch_options(script: str) -> dict[str, str]:
    lines = [line.removeprefix("#SBATCH ") for line in script.splitlines()]
    return dict(o.lstrip("-").split("=", 1) for o in lines if o.startswith("--"))


def srun_argv(script: str) -> list[str]:
    """The srun command line of the script, split as bash would (continuation joined)."""
    text = script.replace("\\\n", " ")
    (line,) = [line for line in text.splitlines() if line.startswith("srun ")]
    return shlex.split(line)


def test_script_allocates_one_launcher_task_per_node_on_the_placed_nodes(tmp_path: Path) -> None:
    backend = SlurmBackend(["n1", "n2"], 2, partition="low", exports={"PYTHONPATH": "/a b"})
    script = backend.script(launch(tmp_path, (1, 2), resume=False))
    assert script.startswith("#!/bin/bash\n")
    options = sbatch_options(script)
    assert options == {
        "job-name": "polytrain-job-7",
        "nodes": "2",
        "ntasks-per-node": "1",
        "cpus-per-task": "1",
        "output": str(tmp_path / "logs" / "job-7-1.log"),
        "partition": "low",
        "nodelist": "n1,n2",
    }
    assert "export PYTHONPATH='/a b'" in script
    argv = srun_argv(script)
    assert argv[:4] == ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "bash"]
    inner, train = argv[5], argv[7:]
    # Node rank, node count, endpoint and run dir are expanded on each node, not here.
    for word in ('"$SLURM_NODEID"', '"$SLURM_NNODES"', '"$rdzv"', '"$run_dir/node$SLURM_NODEID"'):
        assert word in inner, inner
    assert train[1:4] == ["-m", "polytrain", "train"]
    flags = dict(zip(train[4::2], train[5::2], strict=False))
    assert flags["--config"] == str(tmp_path / "my job.toml")
    assert flags["--nproc"] == "1"
    assert flags["--checkpoint-dir"] == str(tmp_path / "ckpt")
    assert flags["--checkpoint-every"] == "10"
    assert "--no-resume" in train and "--resume" not in train
    assert f"run_dir={shlex.quote(str(tmp_path / 'runs' / 'job-7-1'))}" in script


def test_a_resumed_start_on_one_node_runs_all_its_workers_there(tmp_path: Path) -> None:
    script = SlurmBackend(["n1", "n2"], 2).script(launch(tmp_path, (2, 3), resume=True))
    options = sbatch_options(script)
    assert (options["nodes"], options["cpus-per-task"], options["nodelist"]) == ("1", "2", "n2")
    assert "partition" not in options
    train = srun_argv(script)[7:]
    assert "--resume" in train and "--no-resume" not in train
    assert train[train.index("--nproc") + 1] == "2"


def test_rendezvous_port_is_per_job_and_endpoint_is_the_first_nodes_address() -> None:
    script = batch_script(ScriptSpec("j", Path("/j.toml"), nodes=2, nproc_per_node=4))
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)' in script
    assert "NodeAddr=" in script
    assert 'export rdzv="$head_addr:$((20000 + SLURM_JOB_ID % 20000))"' in script


def test_gpu_nodes_get_their_devices_as_gpus() -> None:
    spec = ScriptSpec("j", Path("/j.toml"), nodes=2, nproc_per_node=8, gpus_per_node=True)
    options = sbatch_options(batch_script(spec))
    assert options["gpus-per-node"] == "8" and options["cpus-per-task"] == "1"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nodes": 0}, "nodes = 0"),
        ({"nproc_per_node": 0}, "nproc per node = 0"),
        ({"nodelist": ("n1",)}, "names 1 nodes for a 2-node job"),
        ({"job_name": "a b"}, "without spaces"),
        ({"exports": {"A-B": "1"}}, "not a shell variable name"),
    ],
)
def test_bad_script_specs_are_refused(kwargs: dict[str, object], message: str) -> None:
    base: dict[str, object] = {"job_name": "j", "config": Path("/j"), "nodes": 2}
    with pytest.raises(ConfigError, match=message):
        ScriptSpec(**{"nproc_per_node": 1, **base, **kwargs})  # type: ignore[arg-type]


# -- job records read back ----------------------------------------------------------------------


def test_every_sample_parses_with_values_that_hold_spaces_and_brackets() -> None:
    records = samples()
    assert set(records) == {
        "RUNNING",
        "PENDING",
        "COMPLETING",
        "CANCELLED",
        "COMPLETED",
        "FAILED",
        "SIGNALED",
        "POLYTRAIN",
    }
    job = records["POLYTRAIN"]
    assert (job["JobName"], job["NodeList"], job["NumNodes"]) == ("polytrain-a", "n[1-2]", "2")
    assert (job["Partition"], job["AllocNode:Sid"]) == ("debug", "localhost:6206")
    assert (job["CPUs/Task"], job["ReqB:S:C:T"]) == ("1", "0:0:*:*")
    assert job["StdOut"].endswith("a0.log") and job["Power"] == ""
    line = "JobId=9 JobState=PENDING Reason=(ReqNodeNotAvail, Reserved for maintenance) Nice=0"
    assert parse_job_records(line)["9"]["Reason"] == "(ReqNodeNotAvail, Reserved for maintenance)"


@pytest.mark.parametrize(
    ("case", "code"),
    [
        ("RUNNING", None),
        ("PENDING", None),
        ("COMPLETING", None),  # processes may be alive: not ended yet
        ("COMPLETED", 0),
        ("POLYTRAIN", 0),
        ("FAILED", 3),
        ("SIGNALED", 128 + 9),
        ("CANCELLED", 128 + 15),
    ],
)
def test_states_map_to_exit_codes(case: str, code: int | None) -> None:
    assert exit_code(samples()[case]) == code


@pytest.mark.parametrize("state", ["TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"])
def test_ends_without_a_status_still_count_as_failures(state: str) -> None:
    assert exit_code({"JobState": state, "ExitCode": "0:0"}) == 1


# -- polytrain sched slurm-script ---------------------------------------------------------------

JOB = '[model]\nname = "gpt"\nsize = "tiny"\n[train]\nsteps = 30\ndevice = "cpu"\n'


def test_slurm_script_prints_a_script_for_a_valid_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "job.toml").write_text(JOB)
    argv = ["sched", "slurm-script", str(tmp_path / "job.toml"), "--nodes", "3"]
    code, out, err = run_main([*argv, "--nproc-per-node", "2", "--partition", "p"], capsys)
    assert code == 0, err
    options = sbatch_options(out)
    assert (options["nodes"], options["cpus-per-task"], options["partition"]) == ("3", "2", "p")
    assert options["output"] == "polytrain-%j.out"
    assert "run_dir=runs/slurm-%j" in out


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "does not exist"),
        ("[train\nsteps = 3\n", "is not valid TOML"),
        ("[train]\nstepz = 3\n", "stepz"),
        ("[train]\nsteps = -1\n", "train.steps"),
    ],
)
def test_slurm_script_bad_job_file_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, expected: str
) -> None:
    job = tmp_path / "job.toml"
    if content is not None:
        job.write_text(content)
    out = tmp_path / "job.sbatch"
    code, _, err = run_main(["sched", "slurm-script", str(job), "--out", str(out)], capsys)
    assert_usage_error(code, err, expected)
    assert not out.exists()


def test_slurm_script_bad_counts_are_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "job.toml").write_text(JOB)
    code, _, err = run_main(
        ["sched", "slurm-script", str(tmp_path / "job.toml"), "--nodes", "0"], capsys
    )
    assert_usage_error(code, err, "nodes = 0")


def test_slurm_script_never_overwrites_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "job.toml").write_text(JOB)
    out = tmp_path / "job.sbatch"
    out.write_text("mine\n")
    code, _, err = run_main(
        ["sched", "slurm-script", str(tmp_path / "job.toml"), "--out", str(out)], capsys
    )
    assert_usage_error(code, err, "already exists")
    assert out.read_text() == "mine\n"
    fresh = tmp_path / "new.sbatch"
    code, said, err = run_main(
        ["sched", "slurm-script", str(tmp_path / "job.toml"), "--out", str(fresh)], capsys
    )
    assert code == 0, err
    assert fresh.read_text().startswith("#!/bin/bash\n") and str(fresh) in said

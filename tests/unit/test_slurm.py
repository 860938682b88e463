"""The Slurm backend without Slurm: placement on nodes, the generated script, job records read
back (real ``scontrol -o show job`` samples), and ``polytrain sched slurm-script``'s bad inputs."""

from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path

import pytest

from polytrain.errors import ConfigError
from polytrain.scheduler.backend import Backend, Launch
from polytrain.scheduler.slurm import (
    SlurmBackend,
    SlurmError,
    exit_code,
    nodes_for,
    parse_job_records,
)
from polytrain.scheduler.slurm_script import ScriptSpec, batch_script
from tests.helpers import slurm as slurm_helper
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
    """#SBATCH options as {name: value} ('' for a flag without a value)."""
    lines = [line.removeprefix("#SBATCH ") for line in script.splitlines()]
    options = [o.lstrip("-").partition("=") for o in lines if o.startswith("--")]
    return {name: value for name, _, value in options}


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
        "no-requeue": "",
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
    assert 'export rdzv="$head_addr:$((20000 + SLURM_JOB_ID % 9000))"' in script


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


# -- the backend against a scripted Slurm -------------------------------------------------------


class FakeSlurm:
    """Stands in for ``subprocess.run`` in `polytrain.scheduler.slurm`: records every command
    and answers ``scontrol show job`` from a script of states per Slurm job id."""

    def __init__(self, states: dict[str, list[str]]) -> None:
        self.states = states
        self.calls: list[list[str]] = []
        self.next_id = 41
        self.conf: str | None = None

    def __call__(self, cmd: list[str], **kwargs: object) -> Answer:
        self.calls.append(cmd)
        assert isinstance(cmd, list) and kwargs.get("timeout"), "argument list and a timeout"
        self.conf = dict(kwargs["env"]).get("SLURM_CONF")  # type: ignore[call-overload]
        if cmd[0] == "sbatch":
            self.next_id += 1
            return Answer(0, f"{self.next_id}\n")
        if cmd[0] == "scancel":
            return Answer(0, "")
        slurm_id = cmd[-1]
        if self.states.get(slurm_id) == ["DOWN"]:
            return Answer(1, "", "slurm_load_jobs error: Unable to contact slurm controller")
        if slurm_id not in self.states:
            return Answer(1, "", "slurm_load_jobs error: Invalid job id specified")
        queue = self.states[slurm_id]
        state = queue.pop(0) if len(queue) > 1 else queue[0]
        code = {"FAILED": "3:0", "CANCELLED": "0:15"}.get(state, "0:0")
        return Answer(
            0, f"JobId={slurm_id} JobName=x JobState={state} Reason=None ExitCode={code}\n"
        )


class Answer:
    def __init__(self, returncode: int, stdout: str, stderr: str = "") -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeSlurm:
    slurm = FakeSlurm({})
    monkeypatch.setattr("polytrain.scheduler.slurm.subprocess.run", slurm)
    return slurm


def test_backend_reports_each_end_once_and_never_a_stopped_job(
    fake: FakeSlurm, tmp_path: Path
) -> None:
    backend: Backend = SlurmBackend(["n1", "n2"], 2, slurm_conf=tmp_path / "slurm.conf")
    fake.states = {
        "42": ["PENDING", "RUNNING", "COMPLETED"],
        "43": ["RUNNING", "RUNNING", "FAILED"],
        "44": ["RUNNING", "COMPLETING", "COMPLETING", "CANCELLED"],
    }
    for job, devices in (("a", (0,)), ("b", (1,)), ("c", (2, 3))):
        log = tmp_path / "logs" / f"{job}-0.log"
        backend.start(replace(launch(tmp_path, devices, resume=False), job_id=job, log=log))
    assert [c[0] for c in fake.calls] == ["sbatch"] * 3
    assert fake.conf == str(tmp_path / "slurm.conf")
    assert "#SBATCH --nodelist=n2\n" in (tmp_path / "logs" / "c-0.sbatch").read_text()
    again = replace(
        launch(tmp_path, (0,), resume=True), job_id="d", log=tmp_path / "logs" / "a-0.log"
    )
    with pytest.raises(ConfigError, match=r"a-0.sbatch already exists"):
        backend.start(again)  # a start never overwrites an earlier start's script
    assert backend.poll() == {}  # PENDING, RUNNING, RUNNING
    backend.stop("c")  # scancel, then waits through COMPLETING until CANCELLED
    assert [c[0] for c in fake.calls[-4:]] == ["scancel", "scontrol", "scontrol", "scontrol"]
    assert backend.poll() == {}  # a RUNNING, b RUNNING; c is no longer asked about
    assert backend.poll() == {"a": 0, "b": 3}
    assert backend.poll() == {}


def test_backend_reports_a_job_slurm_forgot_as_failed(fake: FakeSlurm, tmp_path: Path) -> None:
    backend = SlurmBackend(["n1"], 1)
    backend.start(launch(tmp_path, (0,), resume=False))
    fake.states = {}  # `scontrol show job 42`: Invalid job id
    assert backend.poll() == {"job-7": 1}


def test_backend_does_not_fail_jobs_while_the_controller_is_unreachable(
    fake: FakeSlurm, tmp_path: Path
) -> None:
    backend = SlurmBackend(["n1"], 1)
    backend.start(launch(tmp_path, (0,), resume=False))
    fake.states = {"42": ["DOWN"]}
    with pytest.raises(SlurmError, match="Unable to contact slurm controller"):
        backend.poll()
    fake.states = {"42": ["COMPLETED"]}
    assert backend.poll() == {"job-7": 0}  # still tracked: reported once the controller answers


def test_backend_stop_that_never_ends_is_an_error(fake: FakeSlurm, tmp_path: Path) -> None:
    backend = SlurmBackend(["n1"], 1, stop_timeout_s=0.3)
    backend.start(launch(tmp_path, (0,), resume=False))
    fake.states = {"42": ["COMPLETING"]}
    with pytest.raises(SlurmError, match=r"Slurm job 42 \('job-7'\) did not end within 0.3 s"):
        backend.stop("job-7")
    with pytest.raises(ConfigError, match="not running on Slurm"):
        backend.stop("job-7")


# -- the test cluster's skip reasons ------------------------------------------------------------


def test_cluster_without_slurm_and_without_root_skips_with_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(slurm_helper.shutil, "which", lambda name: None)
    monkeypatch.setattr(slurm_helper.os, "geteuid", lambda: 1000)
    with pytest.raises(slurm_helper.SlurmUnavailable) as exc:
        slurm_helper._ensure_binaries()
    assert str(exc.value).startswith("Slurm not installed (munged, slurmctld, slurmd")
    assert "\n" not in str(exc.value)

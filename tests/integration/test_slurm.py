"""Through a real slurmctld: a job preempted by checkpoint resumes on another node count.

A one-host cluster (munged, slurmctld, slurmd n1 and n2; tests/helpers/slurm.py) with 2 device
slots per node: slots 0-1 on n1, 2-3 on n2. Two copies of one tiny GPT job run through
`SlurmBackend` in the order the executor would drive it: A starts on slots (1, 2) (two nodes,
one worker each); once A's step-10 checkpoint has landed A is stopped (scancel), then started
again with ``resume = True`` on slot 3 (one node). B is submitted as a user would, from
``polytrain sched slurm-script`` and ``sbatch``, and runs alongside on one node, unpreempted.
B is the same job, so A's final weights must equal B's up to fp32 round-off (two replicas
averaging gradients vs one). Slurm's records of these runs, captured with
``scontrol -o show job``, are the samples the unit tests parse.

[Note: SGD for the comparison] The job uses SGD, as the repository's other resume-under-another-
layout tests do. Under AdamW the attention key bias, whose exact gradient is zero (a constant
added to every key's score cancels in the softmax), receives only round-off, and Adam divides it
by its own root-mean-square: those round-off differences become lr-sized steps. Measured with
AdamW (lr 3e-3, 40 steps): k.bias differed by up to 6e-5, every other weight by at most 1.6e-6.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from polytrain.cli.sched_slurm import slurm_script_command
from polytrain.scheduler.backend import Launch
from polytrain.scheduler.slurm import SlurmBackend, exit_code
from polytrain.scheduler.slurm_script import ScriptSpec, batch_script
from polytrain.scheduler.store import Store
from polytrain.testing import scaled
from tests.helpers.cli import run_main
from tests.helpers.slurm import SlurmCluster, SlurmUnavailable, start_cluster

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PYTHONPATH = os.pathsep.join(p for p in (str(ROOT / "src"), str(ROOT)) if p)
STEPS, EVERY = 40, 10


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    try:
        with start_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
            yield cluster
    except SlurmUnavailable as exc:
        pytest.skip(f"no Slurm cluster: {exc}")


def job_file(path: Path, final: Path, every: int = 0) -> Path:
    """The job; ``every``: its ``checkpoint.every`` (0: not set, the scheduler picks one)."""
    path.write_text(
        "\n".join(
            [
                "[model]",
                'name = "gpt"',
                'size = "tiny"',
                "[train]",
                f"steps = {STEPS}",
                "global_batch_size = 8",
                'device = "cpu"',
                "seed = 3",
                "eval_every = 0",
                "sample_tokens = 0",
                "[optim]",  # [Note: SGD for the comparison]
                'name = "sgd"',
                "lr = 0.05",
                "momentum = 0.9",
                'schedule = "constant"',
                "warmup_steps = 0",
                "[checkpoint]",
                f'save_final = "{final}"',
                "keep = 10",
                *([f"every = {every}"] if every else []),
            ]
        )
        + "\n"
    )
    return path


def wait_for(ready: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + scaled(timeout_s)
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {scaled(timeout_s):.0f} s")
        time.sleep(0.1)


def test_script_gives_each_node_its_rank_endpoint_and_run_dir(tmp_path: Path) -> None:
    """The generated script run by bash with stand-ins for scontrol, srun and python: each
    "node" (srun's stand-in runs the task once per node id) must receive its own node rank,
    the shared endpoint and its own run directory ([Note: per-node expansion])."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {
        "scontrol": 'if [ "$1 $2" = "show hostnames" ]; then echo n7; echo n8; '
        'else echo "NodeName=n7 Arch=x86_64 NodeAddr=10.1.2.3 NodeHostName=h7"; fi',
        # srun: drop its options, then run the task once per node with that node's id.
        "srun": 'while [[ "$1" == --* ]]; do shift; done; '
        'for i in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_NODEID=$i "$@" || exit; done',
        "fake-python": f'printf "%s\\n" "$*" >> {tmp_path}/calls.txt',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    spec = ScriptSpec(
        "j", Path("/jobs/a b.toml"), nodes=2, nproc_per_node=3, python=str(bin_dir / "fake-python")
    )
    (tmp_path / "job.sbatch").write_text(batch_script(spec))
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "45678",
        "SLURM_JOB_NODELIST": "n[7-8]",
        "SLURM_NNODES": "2",
    }
    done = subprocess.run(
        ["bash", str(tmp_path / "job.sbatch")], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    common = "-m polytrain train --config /jobs/a b.toml --nproc 3 --nnodes 2"
    endpoint = "--rdzv-endpoint 10.1.2.3:20678"
    assert calls == [
        f"{common} --node-rank 0 {endpoint} --out-dir runs/slurm-45678",
        f"{common} --node-rank 1 {endpoint} --out-dir runs/slurm-45678/node1",
    ]


def test_preempted_job_resumes_on_fewer_nodes_to_the_same_weights(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    backend = SlurmBackend(
        slurm.nodes,
        slurm.cpus_per_node,
        slurm_conf=slurm.conf,
        exports={"PYTHONPATH": PYTHONPATH},
        python=sys.executable,
    )

    def launch(job: str, start: int, devices: tuple[int, ...], resume: bool) -> Launch:
        return Launch(
            job_id=job,
            config=tmp_path / f"{job}.toml",
            devices=devices,
            run_dir=tmp_path / "runs" / f"{job}-{start}",
            checkpoint_dir=tmp_path / "ckpt" / job,
            checkpoint_every=EVERY,
            resume=resume,
            log=tmp_path / "logs" / f"{job}-{start}.log",
        )

    for job in ("a", "b"):
        job_file(tmp_path / f"{job}.toml", tmp_path / f"{job}.safetensors")
    t0 = time.monotonic()
    backend.start(launch("a", 0, (1, 2), resume=False))  # n1 + n2, one worker each
    # B as a user submits it: `polytrain sched slurm-script`, then sbatch (Slurm picks the node).
    slurm_script_command(
        tmp_path / "b.toml",
        nodes=1,
        nproc_per_node=1,
        out=tmp_path / "b.sbatch",
        python=sys.executable,
    )
    submit = subprocess.run(
        ["sbatch", "--parsable", "b.sbatch"],
        cwd=tmp_path,
        env={**slurm.env, "PYTHONPATH": PYTHONPATH},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert submit.returncode == 0, submit.stderr
    b_id = submit.stdout.strip()
    first = tmp_path / "ckpt" / "a" / f"step_{EVERY:09d}" / "manifest.json"
    wait_for(first.exists, 90, "A's first checkpoint")
    t_checkpoint = time.monotonic() - t0
    a_first = backend.submitted["a"][0]
    backend.stop("a")
    t_stop = time.monotonic() - t0 - t_checkpoint
    stopped = backend.record(a_first)
    assert stopped is not None and stopped["JobState"] == "CANCELLED", stopped
    assert stopped["NodeList"] == "n[1-2]" and stopped["NumNodes"] == "2", stopped
    newest = max(p.name for p in (tmp_path / "ckpt" / "a").glob("step_*"))
    assert newest < f"step_{STEPS:09d}", f"A reached its last step before the stop ({newest})"

    backend.start(launch("a", 1, (3,), resume=True))  # one node now: n2
    ended: dict[str, int] = {}
    wait_for(lambda: ended.update(backend.poll()) or ended, 120, "A to end")
    wait_for(lambda: exit_code(backend.record(b_id) or {}) is not None, 60, "B to end")
    b_record = backend.record(b_id) or {}
    t_all = time.monotonic() - t0
    logs = {p.name: p.read_text() for p in (tmp_path / "logs").glob("*.log")}
    b_log = (tmp_path / f"polytrain-{b_id}.out").read_text()
    controller = slurm.log("slurmctld")[-2000:]
    assert ended == {"a": 0} and exit_code(b_record) == 0, (
        ended,
        b_record,
        logs,
        b_log,
        controller,
    )
    resumed = backend.record(backend.submitted["a"][1])
    assert resumed is not None and resumed["NodeList"] == "n2", resumed
    said = re.search(r"polytrain: resumed from .*step_\d+ \(step (\d+)\)", logs["a-1.log"])
    assert said is not None, logs["a-1.log"]
    metrics = (tmp_path / "runs" / "a-1" / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(line)["step"] for line in metrics]
    assert logged and min(logged) > int(said[1]) and max(logged) == STEPS, logged
    assert "2 rank(s) in all" in logs["a-0.log"] and "1 rank(s) in all" in logs["a-1.log"]
    assert (tmp_path / "runs" / f"slurm-{b_id}" / "metrics.jsonl").exists(), b_log
    print(
        f"A's step-{EVERY} checkpoint {t_checkpoint:.1f} s after submit; stop (scancel until "
        f"ended) {t_stop:.1f} s; A resumed on 1 node ({newest}) and B ended {t_all:.1f} s "
        "after the first submit"
    )

    a = load_file(str(tmp_path / "a.safetensors"))
    b = load_file(str(tmp_path / "b.safetensors"))
    assert set(a) == set(b)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"max |A - B| over all weights: {worst:.3g}")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5, msg=name)
    if os.environ.get("POLYTRAIN_SLURM_SAMPLES"):  # refresh the unit tests' samples
        out = subprocess.run(
            ["scontrol", "-o", "show", "job"], env=slurm.env, capture_output=True, text=True
        ).stdout
        Path(os.environ["POLYTRAIN_SLURM_SAMPLES"]).write_text(out)


def test_sched_serve_runs_jobs_on_slurm(
    slurm: SlurmCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`polytrain sched serve --slurm-nodes`: the executor and a policy drive the same Slurm
    backend; two submitted jobs (one on 2 device slots, one on 1) run through sbatch to the
    end, and their final weights agree (the same job: 2 replicas vs 1, fp32 round-off)."""
    monkeypatch.chdir(tmp_path)  # where `submit` runs: the jobs' working directory
    state = tmp_path / "state"
    Store(state, create=True).set_cluster(4, "cpu")  # as `serve --devices 4` writes it
    for name, devices in (("a", "2"), ("b", "1")):  # queued first: serve finds both at once
        job = job_file(tmp_path / f"{name}.toml", tmp_path / f"{name}.safetensors", every=STEPS)
        args = ["sched", "submit", str(job), "--state", str(state), "--devices", devices]
        code, _, err = run_main(args, capsys)
        assert code == 0, err
    serve = subprocess.Popen(
        [sys.executable, "-m", "polytrain", "sched", "serve", "--state", str(state),
         "--devices", "4", "--slurm-nodes", ",".join(slurm.nodes), "--policy", "fifo",
         "--poll", "0.2s", "--until-idle"],
        env={**slurm.env, "PYTHONPATH": PYTHONPATH}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        out, err = serve.communicate(timeout=scaled(240))
    finally:
        serve.kill()
    assert serve.returncode == 0, err[-2000:] + slurm.log("slurmctld")[-2000:]
    assert "2 finished" in out, out
    a, b = (load_file(str(tmp_path / f"{n}.safetensors")) for n in "ab")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5

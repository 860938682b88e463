"""Issue 11, case 5: output paths are checked before any worker starts, the final weights never
replace a file, and two runs cannot share one ``--out-dir`` ([Note: output paths])."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from polytrain.cli.app import main
from polytrain.errors import OutputError
from polytrain.testing.jobs import run_job
from polytrain.trainer.export import save_weights
from polytrain.trainer.outputs import LOCK_NAME, RunLock
from tests.conftest import small_job

ROOT = Path(__file__).resolve().parents[2]
UNWRITABLE = "/proc/polytrain-test"  # not writable even for root


def run(args: list[str], capsys: pytest.CaptureFixture[str], dry: bool = True) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(["train", *(["--dry-run"] if dry else []), *args])
    return int(exc.value.code or 0), capsys.readouterr().err


def cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    a_file = tmp / "a_file"
    a_file.write_text("mine")
    return {
        "save-final under a file": (["--save-final", f"{a_file}/w.safetensors"], "is a file"),
        "save-final unwritable": (["--save-final", f"{UNWRITABLE}/w.st"], "cannot create files"),
        "save-final is a directory": (["--save-final", str(tmp)], "already exists (a directory)"),
        "trace under a file": (["--trace", f"{a_file}/t.json"], "is a file, not a directory"),
        "trace unwritable": (["--trace", f"{UNWRITABLE}/t.json"], "cannot create files"),
        "trace exists": (["--trace", str(a_file)], "already exists (a file)"),
        "checkpoint-dir is a file": (["--checkpoint-dir", str(a_file)], "is a file, not a dir"),
        "checkpoint-dir unwritable": (["--checkpoint-dir", UNWRITABLE], "cannot create files"),
        "out-dir is a file": (["--out-dir", str(a_file)], "is a file, not a directory"),
        "out-dir unwritable": (["--out-dir", f"{UNWRITABLE}/run"], "cannot create files"),
    }


CASE_NAMES = [
    "save-final under a file",
    "save-final unwritable",
    "save-final is a directory",
    "trace under a file",
    "trace unwritable",
    "trace exists",
    "checkpoint-dir is a file",
    "checkpoint-dir unwritable",
    "out-dir is a file",
    "out-dir unwritable",
]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_output_paths_are_checked_in_preflight(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 11, case 5: before, these trained the whole run and then failed (weights lost),
    # or printed a traceback.
    args, expected = cases(tmp_path)[name]
    code, err = run(["--model", "mlp", *args], capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("polytrain: error: "), err
    assert expected in lines[0], lines[0]
    assert (tmp_path / "a_file").read_text() == "mine"


def test_final_weights_never_replace_a_file_created_during_the_run(tmp_path: Path) -> None:
    # Issue 11, case 5: before, a file that appeared at --save-final was overwritten, and an
    # existing <path>.tmp was clobbered.
    target = tmp_path / "w.safetensors"
    target.write_bytes(b"the user's file")
    (tmp_path / "w.safetensors.tmp").write_bytes(b"also the user's")
    state = {"w": torch.arange(3.0)}
    with pytest.raises(OutputError, match="was left alone: what the run wrote there is in") as exc:
        save_weights(state, target)
    assert target.read_bytes() == b"the user's file"
    assert (tmp_path / "w.safetensors.tmp").read_bytes() == b"also the user's"
    sibling = Path(str(exc.value).rsplit(" ", 1)[1].strip("'"))
    assert sibling.parent == tmp_path and torch.equal(load_file(str(sibling))["w"], state["w"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["w.safetensors", "w.safetensors.tmp", sibling.name]
    )  # no temporary file left behind
    fresh = tmp_path / "new.safetensors"
    assert save_weights(state, fresh) == fresh and torch.equal(
        load_file(str(fresh))["w"], state["w"]
    )


def hold_lock(run_dir: Path) -> subprocess.Popen[str]:
    code = (
        "import sys, time\n"
        "from polytrain.trainer.outputs import RunLock\n"
        f"RunLock({str(run_dir)!r}).acquire()\n"
        "print('locked', flush=True)\n"
        "time.sleep(120)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


@pytest.mark.slow
def test_two_runs_cannot_share_an_out_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 11, case 5: before, the second run started and wrote into the first one's files.
    run_dir = tmp_path / "run"
    holder = hold_lock(run_dir)
    try:
        args = ["--model", "mlp", "--nproc", "1", "--steps", "1", "--out-dir", str(run_dir)]
        code, err = run(args, capsys, dry=False)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"is in use by another run (pid {holder.pid})" in err
        assert not (run_dir / "logs").exists()  # refused before any worker started
    finally:
        holder.kill()
        holder.wait()
    # The dead run's lock file is still there; the next run takes it over.
    assert (run_dir / LOCK_NAME).exists()
    with RunLock(run_dir):
        assert (run_dir / LOCK_NAME).read_text().strip() == str(os.getpid())
        with pytest.raises(Exception, match="in use by another run"):
            RunLock(run_dir).acquire()
    assert not (run_dir / LOCK_NAME).exists()  # released at exit


@pytest.mark.slow  # one training run in this process
def test_the_trace_never_replaces_a_file_created_during_the_run(tmp_path: Path) -> None:
    # Issue 11, case 5: the merged trace used to be written over whatever stood at --trace, and
    # its per-rank parts over any <trace>.rank<r>; parts now live in the run directory.
    trace = tmp_path / "t.json"
    (tmp_path / "t.json.rank0").write_text("the user's part")
    job = small_job(observe={"trace": str(trace), "out_dir": str(tmp_path / "run")})
    trace.write_text("the user's trace")  # appears after pre-flight, during the run
    with pytest.raises(Exception, match="was left alone: what the run wrote there is in"):
        run_job(job)
    assert trace.read_text() == "the user's trace"
    assert (tmp_path / "t.json.rank0").read_text() == "the user's part"
    siblings = list(tmp_path.glob("t-*.json"))
    assert len(siblings) == 1 and "traceEvents" in siblings[0].read_text()

"""`LocalBackend` with a stand-in trainer (a shell script, no torch; about a second in all).

What a restart relies on: the exit status reaches a file, ``stop`` ends the whole process
tree, and a second backend (a restarted scheduler, not the parent) adopts a live job, learns
its exit status from the file, and refuses one that vanished without a status.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from polytrain.scheduler.backend import Launch
from polytrain.scheduler.local import LocalBackend, trainer_command

# Stands in for `python3`: `$0 -m polytrain train ...`; the behaviour comes from $BEHAVIOUR.
FAKE = """#!/bin/sh
case "$BEHAVIOUR" in
  exit3) echo "trainer args: $*"; exit 3 ;;
  tree) sleep 300 & echo $! > "$CHILD_PID"; wait ;;
esac
"""


def launch(tmp_path: Path, job_id: str = "j", start: int = 1) -> Launch:
    home = tmp_path / "jobs" / job_id
    return Launch(
        job_id=job_id,
        config=home / "job.toml",
        devices=(0, 1),
        run_dir=home / f"start-{start}",
        checkpoint_dir=home / "checkpoints",
        checkpoint_every=5,
        resume=start > 1,
        log=home / f"start-{start}.log",
        workdir=tmp_path,
    )


def backend(tmp_path: Path, behaviour: str) -> LocalBackend:
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    env = {**os.environ, "BEHAVIOUR": behaviour, "CHILD_PID": str(tmp_path / "child.pid")}
    return LocalBackend("cpu", python=str(fake), grace_s=5.0, env=env)


def ended(b: LocalBackend, timeout: float = 20.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = b.poll()
        if out:
            return out
        time.sleep(0.05)
    raise AssertionError("the job did not end")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_the_command_line_and_the_exit_status(tmp_path: Path) -> None:
    b = backend(tmp_path, "exit3")
    first = launch(tmp_path, start=2)
    b.start(first)
    assert ended(b) == {"j": 3}
    assert (tmp_path / "jobs/j/start-2.exit").read_text().strip() == "3"
    printed = (tmp_path / "jobs/j/start-2.log").read_text()
    assert " ".join(trainer_command(first, "cpu", "")[1:]) in printed
    assert "--nproc 2 --device cpu" in printed and printed.rstrip().endswith("--resume")


def test_stop_ends_the_whole_tree_and_a_restart_adopts_or_refuses(tmp_path: Path) -> None:
    b = backend(tmp_path, "tree")
    b.start(launch(tmp_path))
    pid_file = tmp_path / "child.pid"
    deadline = time.monotonic() + 20
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    # A restarted scheduler: not the parent, it adopts the live job and can stop it.
    again = backend(tmp_path, "tree")
    assert again.adopt(launch(tmp_path))
    assert again.poll() == {}
    again.stop("j")
    assert not alive(grandchild)
    b.poll()  # the first backend reaps its shell
    # Gone without an exit status: refused, so the job resumes from its checkpoint.
    assert not backend(tmp_path, "tree").adopt(launch(tmp_path))
    assert not backend(tmp_path, "tree").adopt(launch(tmp_path, "never-started"))


def test_an_exit_status_written_while_the_scheduler_was_down_is_reported(
    tmp_path: Path,
) -> None:
    b = backend(tmp_path, "exit3")
    b.start(launch(tmp_path))
    ended(b)
    again = backend(tmp_path, "exit3")
    assert again.adopt(launch(tmp_path))
    assert again.poll() == {"j": 3}


def test_a_gpu_job_sees_only_its_devices(tmp_path: Path) -> None:
    fake = tmp_path / "fake-python"
    fake.write_text('#!/bin/sh\necho "visible=$CUDA_VISIBLE_DEVICES args=$*"\n')
    fake.chmod(0o755)
    b = LocalBackend("cuda", python=str(fake), env=dict(os.environ))
    b.start(launch(tmp_path))
    assert ended(b) == {"j": 0}
    printed = (tmp_path / "jobs/j/start-1.log").read_text()
    assert "visible=0,1 " in printed and "--device cuda" in printed

"""Every command in README.md's "Using it" block runs as written, so the README cannot drift.

The block is parsed from README.md at test time: an edited example is tested as edited. ``train``
commands run for two real steps (the whole job is resolved and pre-flighted first: config, model
built on the meta device, mesh, partition, plans), once per job this host resolves them to;
``--dry-run`` examples, ``plan`` and ``polytrain doctor`` run as they are (in this process: they
start no worker). The files an example names (``job.toml``, ``corpus.txt``, the
``mypkg.models:build`` factory, the checkout's ``examples/``) are there first, as a user would
have them.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from polytrain.config import devices
from tests.helpers.cli import run_main

# The host's own GPU count, taken before conftest hides GPUs from the jobs a test builds in
# its process: the examples run in a subprocess, which sees them.
HOST_GPUS = devices.visible_gpus
ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

USER_FACTORY = '''
from torch import nn


def build(spec):
    """A user model: one nn.Sequential child per pipeline block."""
    return nn.Sequential(
        nn.Embedding(spec.vocab_size, 16), nn.Linear(16, 32), nn.GELU(),
        nn.Linear(32, spec.vocab_size),
    )
'''


def readme_commands() -> list[list[str]]:
    """The ``polytrain ...`` lines of the first bash block under "## Using it", as argv lists
    (comments dropped; the ``...`` placeholder of ``--dry-run ...`` dropped)."""
    text = README.read_text()
    section = text.split("## Using it", 1)[1]
    match = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert match, 'README.md: no ```bash block under "## Using it"'
    commands = []
    for line in match.group(1).splitlines():
        argv = [a for a in shlex.split(line, comments=True) if a != "..."]
        if argv:
            assert argv[0] == "polytrain", f"README example does not start with polytrain: {line}"
            commands.append(argv[1:])
    return commands


COMMANDS = readme_commands()


def _id(argv: list[str]) -> str:
    return " ".join(argv)


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    """A directory holding what the examples name: job.toml, corpus.txt, mypkg/models.py."""
    (tmp_path / "job.toml").write_text('[model]\nname = "mlp"\n\n[train]\nsteps = 100\n')
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "models.py").write_text(USER_FACTORY)
    return tmp_path


def polytrain(argv: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join([str(cwd), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "polytrain.cli.app", *argv],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_readme_block_has_the_examples() -> None:
    assert len(COMMANDS) >= 5
    assert ["doctor"] in COMMANDS
    assert all(argv[0] in ("train", "doctor", "plan") for argv in COMMANDS)


TRAIN = [argv for argv in COMMANDS if argv[0] == "train" and "--dry-run" not in argv]
# A training example is proven by training it (below), which resolves and pre-flights the same
# job first; a separate dry run of it would only repeat that start-up.
VALIDATE = [argv for argv in COMMANDS if argv not in TRAIN]


def shortened(argv: list[str], out_dir: Path | str) -> list[str]:
    """The example cut to two steps (the last --steps wins), no eval, no sample, into out_dir."""
    return [
        *argv,
        *("--steps", "2", "--eval-every", "0", "--no-progress"),
        *("--set", "train.sample_tokens=0", "--out-dir", str(out_dir)),
    ]


def run_here(
    argv: list[str],
    user_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> tuple[int, str, str]:
    """``polytrain ARGV`` in this process, as a user in ``user_dir`` on this host runs it: for
    the commands that start no worker, where a new interpreter would only add its start-up."""
    with monkeypatch.context() as patch:
        patch.chdir(user_dir)
        patch.syspath_prepend(str(user_dir))
        patch.setattr(devices, "visible_gpus", HOST_GPUS)
        try:
            return run_main(argv, capsys)
        finally:
            for name in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
                del sys.modules[name]  # each test's user_dir has its own mypkg


@pytest.mark.slow  # the planner's searches and pre-flights: up to a second each
@pytest.mark.parametrize("argv", VALIDATE, ids=_id)
def test_readme_example_validates(
    argv: list[str],
    user_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_here(argv, user_dir, monkeypatch, capsys)
    assert code == 0, f"polytrain {_id(argv)}\n{err}"
    if argv[0] == "train":
        assert "[parallel]" in out  # the resolved job, printed as TOML
    elif argv[0] == "plan" and "--layout" in argv:
        assert "ms/step" in out and "memory: total" in out  # its parts
    elif argv[0] == "plan":
        assert "plan:" in out  # the chosen layout, then the table
    else:
        assert "torch" in out
    if "--save-final" in argv:
        assert not (user_dir / argv[argv.index("--save-final") + 1]).exists()  # dry run


def resolved_job(
    argv: list[str],
    user_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> str:
    """The job this host resolves ``argv`` to (its --dry-run TOML): what the workers would
    receive."""
    code, out, err = run_here([*shortened(argv, "run"), "--dry-run"], user_dir, monkeypatch, capsys)
    assert code == 0, f"polytrain {_id(argv)} --dry-run\n{err}"
    return "\n".join(line for line in out.splitlines() if not line.startswith("#"))


@pytest.fixture(scope="module")
def trained() -> dict[str, str]:
    """Resolved job -> the example that trained it, in this session."""
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("argv", TRAIN, ids=_id)
def test_readme_example_trains_two_steps(
    argv: list[str],
    user_dir: Path,
    trained: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The same command, shortened to two steps, trains and exits 0. Two examples that resolve
    to one job on this host (``train`` and ``train --device cpu --nproc 2`` where there is no
    GPU) train it once: the workers receive only the resolved job."""
    job = resolved_job(argv, user_dir, monkeypatch, capsys)
    if job in trained:
        pytest.skip(f"this host resolves it to the job `polytrain {trained[job]}` trained")
    short = shortened(argv, user_dir / "run")
    proc = polytrain(short, user_dir, timeout=600)
    assert proc.returncode == 0, f"polytrain {_id(short)}\n{proc.stderr[-3000:]}"
    metrics = (user_dir / "run" / "metrics.jsonl").read_text()
    assert '"step": 2' in metrics or '"step":2' in metrics
    if "--save-final" in argv:
        assert (user_dir / argv[argv.index("--save-final") + 1]).stat().st_size > 0
    trained[job] = _id(argv)

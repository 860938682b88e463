"""[Note: device resolution] as a plain function and through `JobConfig`: torch.cuda's answers
monkeypatched (no GPU here), no processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from polytrain.config import JobConfig, devices, job_from_dict, load_job, save_job
from polytrain.config.devices import resolve_devices
from polytrain.errors import ConfigError
from tests.helpers.devices import see_gpus


@pytest.mark.parametrize(
    ("gpus", "device", "nproc", "expected"),
    [
        (0, "auto", "auto", ("cpu", 2)),
        (0, "auto", 3, ("cpu", 3)),
        (0, "cpu", "auto", ("cpu", 2)),
        (4, "auto", "auto", ("cuda", 4)),
        (4, "auto", "gpu", ("cuda", 4)),
        (4, "auto", 2, ("cuda", 2)),
        (4, "cuda", "auto", ("cuda", 4)),
        (4, "cpu", "auto", ("cpu", 2)),  # an explicit CPU stays on the CPU
        (4, "cpu", "gpu", ("cpu", 4)),
        (4, "cpu", 3, ("cpu", 3)),
    ],
)
def test_resolution(
    monkeypatch: pytest.MonkeyPatch,
    gpus: int,
    device: str,
    nproc: int | str,
    expected: tuple[str, int],
) -> None:
    see_gpus(monkeypatch, gpus)
    assert resolve_devices(device, nproc) == expected


@pytest.mark.parametrize(
    ("device", "nproc", "message"),
    [
        ("auto", "gpu", "launch.nproc = 'gpu' but torch sees no GPU here"),
        ("cpu", "gpu", "launch.nproc = 'gpu' but torch sees no GPU here"),
        ("cuda", "auto", "train.device = 'cuda' but torch sees no CUDA device"),
        ("cuda", 2, "train.device = 'cuda' but torch sees no CUDA device"),
    ],
)
def test_a_device_this_machine_lacks(
    monkeypatch: pytest.MonkeyPatch, device: str, nproc: int | str, message: str
) -> None:
    see_gpus(monkeypatch, 0)
    with pytest.raises(ConfigError, match=message):
        resolve_devices(device, nproc)


def test_a_cpu_job_with_a_count_never_asks_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    def probe() -> int:
        raise AssertionError("probed")

    monkeypatch.setattr(devices, "visible_gpus", probe)
    assert resolve_devices("cpu", 2) == ("cpu", 2)


def test_the_default_job_on_a_gpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    see_gpus(monkeypatch, 8)
    job = JobConfig()
    assert (job.train.device, job.launch.nproc) == ("cuda", 8)
    assert job.world_size == 8 and job.parallel.dp == 8


def test_visible_gpus_asks_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()  # the real probe, under torch.cuda's patched answers
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert devices.visible_gpus() == 3
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.visible_gpus() == 0


def test_a_built_job_holds_the_count(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``nproc = "gpu"`` in a TOML file loads; the job saved from it (the run's job.toml, which
    the workers load) holds the count, and loads back equal."""
    see_gpus(monkeypatch, 4)
    path = tmp_path / "job.toml"
    path.write_text('[launch]\nnproc = "gpu"\n\n[train]\ndevice = "auto"\n')
    job = job_from_dict(load_job(path))
    assert (job.train.device, job.launch.nproc, job.launch.num_procs) == ("cuda", 4, 4)
    save_job(job, tmp_path / "saved.toml")
    assert "nproc = 4\n" in (tmp_path / "saved.toml").read_text()
    see_gpus(monkeypatch, 2)  # a worker loading it does not count again
    again = job_from_dict(load_job(tmp_path / "saved.toml"))
    assert again == job


def test_a_word_other_than_the_choices_is_a_type_error() -> None:
    with pytest.raises(ConfigError, match="launch.nproc = 'all' has the wrong type"):
        job_from_dict({"launch": {"nproc": "all"}})

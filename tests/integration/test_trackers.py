"""Issue 41 item 5: experiment trackers hold ``metrics.jsonl``'s records, step by step, read back
with each package's own reader; a tracker whose package is missing is refused before launch."""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from polytrain.comm.init import shutdown
from polytrain.core.strategy import NonFiniteLossError
from polytrain.errors import ConfigError
from polytrain.measure import mfu
from polytrain.observe.trackers import MLflowTracker, WandbTracker, scalars
from polytrain.trainer.loop import train
from tests.helpers.cli import assert_usage_error, run_main

_calls = {"loss": 0}


def nan_from_third_call(predictions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy, NaN from its third call on real tensors (a job's loss, ``model.loss``)."""
    if predictions.device.type != "meta":  # MFU's FLOP count runs the model on meta tensors
        _calls["loss"] += 1
    loss = torch.nn.functional.cross_entropy(predictions.flatten(0, -2), targets.flatten())
    return loss * float("nan") if _calls["loss"] >= 3 else loss


@pytest.fixture
def tracker_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Trackers' defaults (local stores, W&B offline), W&B's own files kept out of $HOME."""
    for name in (
        "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_NAME",
        "MLFLOW_EXPERIMENT_ID",
        "WANDB_MODE",
        "WANDB_PROJECT",
    ):
        monkeypatch.delenv(name, raising=False)
    # MLflow 3 opens a file store only with this set (the tests read the stores back with it);
    # the tracker sets it only while its client builds its own default store.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _expected(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """metric -> [(step, value)] of every numeric field, as the trackers should hold them."""
    series: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for key, value in scalars(record).items():
            series.setdefault(key, []).append((record["step"], value))
    return series


def _tensorboard(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def _as_float32(series: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard's scalars are float32 (``simple_value``)."""
    return {k: [(s, float(np.float32(v))) for s, v in points] for k, points in series.items()}


def _mlflow_run(store: Path) -> tuple[Any, Any]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    (run,) = client.search_runs(["0"])
    return client, run


def _mlflow(client: Any, run: Any, keys: list[str]) -> dict[str, list[tuple[int, float]]]:
    return {
        key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        for key in keys
    }


# W&B's run file (``run-<id>.wandb``) is a LevelDB-style log of protobuf `Record`s: a 7-byte
# header, then 32 KiB blocks of chunks (crc32, length, type: 1 full, 2 first, 3 middle, 4 last).
_WANDB_HEADER = b":W&B\xe1\xbe\x00"
_BLOCK = 32768


def _wandb_run(run_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], str, int | None]:
    """metric -> [(step, value)], the run's display name and its exit code (None before its
    end), read from the run file of the one W&B run in ``run_dir``."""
    from wandb.proto import wandb_internal_pb2

    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data = run_file.read_bytes()
    assert data[:7] == _WANDB_HEADER, f"not a W&B run file this test reads: {data[:7]!r}"
    pos, pending, series, name, exit_code = 7, b"", {}, "", None
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a chunk header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _, length, kind = struct.unpack_from("<IHB", data, pos)
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind not in (1, 4):
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        pending = b""
        if record.WhichOneof("record_type") == "run":
            name = record.run.display_name
        if record.WhichOneof("record_type") == "exit":
            exit_code = record.exit.exit_code
        if record.WhichOneof("record_type") != "history":
            continue
        for item in record.history.item:
            key = "/".join(item.nested_key) or item.key
            if not key.startswith("_"):  # W&B's own _step, _runtime, _timestamp
                series.setdefault(key, []).append(
                    (record.history.step.num, json.loads(item.value_json))
                )
    return series, name, exit_code


@pytest.mark.slow
def test_trackers_hold_the_metrics_records_of_a_data_parallel_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tracker_env: None
) -> None:
    for package in ("tensorboard", "mlflow", "wandb"):
        pytest.importorskip(package)
    run_dir = tmp_path / "run"
    # log_every 2 over 6 steps: three records, the last with val_loss
    args = ["train", "--model", "gpt", "--size", "tiny", "--steps", "6", "--device", "cpu"]
    args += ["--nproc", "2", "--dp", "2", "--trackers", "tensorboard,mlflow,wandb"]
    args += ["--out-dir", str(run_dir), "--no-progress", "--eval-every", "0"]
    args += ["--set", "observe.log_every=2", "--set", "train.sample_tokens=0"]
    code, _, err = run_main(args, capsys)
    assert code == 0, err

    records = _records(run_dir)
    assert [r["step"] for r in records] == [2, 4, 6]
    expected = _expected(records)
    assert {"loss", "lr", "step_time_s", "samples_per_s", "val_loss"} <= expected.keys()

    assert _tensorboard(run_dir / "tensorboard") == _as_float32(expected)

    client, run = _mlflow_run(run_dir / "mlruns")
    assert (run.info.run_name, run.info.status) == ("run", "FINISHED")
    assert run.data.params["train.steps"] == "6"
    assert run.data.params["parallel.dp"] == "2"
    assert set(run.data.metrics) == expected.keys()
    assert _mlflow(client, run, list(expected)) == expected

    assert _wandb_run(run_dir) == (expected, "run", 0)


@pytest.mark.slow  # one rank, in-process, but three trackers' start-up: about 7 s
def test_trackers_close_their_runs_as_failed_when_training_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, job_factory: Any, tracker_env: None
) -> None:
    """One rank in this process: the loss turns NaN at step 3 and ``stop`` raises. The steps
    logged before hold MFU (the device read as an H200, as in tests/unit/test_mfu.py), and
    every run is closed: MLflow's as FAILED, W&B's with exit code 1, TensorBoard's written."""
    for package in ("tensorboard", "mlflow", "wandb"):
        pytest.importorskip(package)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _=None: "NVIDIA H200")
    on_cpu = mfu.peak_flops
    monkeypatch.setattr(mfu, "peak_flops", lambda _, dtype: on_cpu(torch.device("cuda"), dtype))
    monkeypatch.setitem(_calls, "loss", 0)
    run_dir = tmp_path / "run"
    job = job_factory(
        model={"name": "gpt", "size": "tiny", "loss": f"{__name__}:nan_from_third_call"},
        train={"steps": 5, "on_nonfinite": "stop"},
        observe={
            "out_dir": str(run_dir),
            "log_every": 1,
            "trackers": ["tensorboard", "mlflow", "wandb"],
        },
    )
    try:
        with pytest.raises(NonFiniteLossError, match="at step 3"):
            train(job)
    finally:
        shutdown()

    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    expected = _expected(records)
    assert "mfu" in expected
    assert _tensorboard(run_dir / "tensorboard") == _as_float32(expected)
    client, run = _mlflow_run(run_dir / "mlruns")
    assert run.info.status == "FAILED"
    assert _mlflow(client, run, list(expected)) == expected
    assert _wandb_run(run_dir) == (expected, "run", 1)


@pytest.mark.slow  # two trackers opened twice, in-process: a few seconds of start-up
def test_a_restarted_rank_continues_its_trackers_runs(tmp_path: Path, tracker_env: None) -> None:
    """[Note: one tracker run per training run]: a rank that opens its trackers again in the
    same run directory (an elastic restart) logs into the same MLflow and W&B runs."""
    for package in ("mlflow", "wandb"):
        pytest.importorskip(package)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    job = {"train": {"steps": 4}}
    for step, failed in ((1, True), (2, False)):  # killed after step 1, restarted
        trackers = [MLflowTracker(run_dir, job), WandbTracker(run_dir, job)]
        for tracker in trackers:
            tracker.log({"loss": 1.0 / step}, step)
            tracker.close(failed=failed)
    client, run = _mlflow_run(run_dir / "mlruns")  # one run, both steps, finished
    assert run.info.status == "FINISHED"
    assert _mlflow(client, run, ["loss"]) == {"loss": [(1, 1.0), (2, 0.5)]}
    assert run.data.params["train.steps"] == "4"
    # W&B writes each open to offline-run-<time>-<id> (a "-1" after it when two share a second)
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    opened = [path.name for path in (run_dir / "wandb").glob("offline-run-*")]
    assert opened and all(f"-{run_id}" in name for name in opened), opened


def test_mlflows_file_store_opt_in_is_not_left_in_the_process(
    tmp_path: Path, tracker_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default store needs ``MLFLOW_ALLOW_FILE_STORE`` only while the client builds it: a
    user's process that calls ``polytrain.train`` keeps its environment as it was."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    tracker = MLflowTracker(tmp_path, {"train": {"steps": 2}})
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ
    tracker.log({"loss": 1.5}, 1)  # the store the client built is still the one it uses
    tracker.close()
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client, run = _mlflow_run(tmp_path / "mlruns")
    assert _mlflow(client, run, ["loss"]) == {"loss": [(1, 1.5)]}


@pytest.mark.parametrize(
    ("tracker", "module"),
    [("tensorboard", "torch.utils.tensorboard"), ("mlflow", "mlflow"), ("wandb", "wandb")],
)
def test_a_tracker_without_its_package_is_refused_before_launch(
    tracker: str, module: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    code, _, err = run_main(["train", "--dry-run", "--model", "mlp", "--trackers", tracker], capsys)
    assert_usage_error(code, err, f"pip install 'polytrain[{tracker}]'")
    assert f"observe.trackers includes {tracker!r}" in err


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("tensorboard,tensorflow", "observe.trackers[1] = 'tensorflow' is not a valid choice"),
        ("mlflow,mlflow", "names mlflow more than once"),
    ],
)
def test_tracker_names_are_checked_in_one_line(
    value: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_main(["train", "--dry-run", "--model", "mlp", "--trackers", value], capsys)
    assert_usage_error(code, err, expected)


def test_the_trackers_flag_is_a_comma_list_of_the_field(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("tensorboard")
    job = tmp_path / "job.toml"
    job.write_text('[observe]\ntrackers = ["tensorboard"]\n')
    code, out, err = run_main(
        ["train", "--dry-run", "--model", "mlp", "--config", str(job)], capsys
    )
    assert code == 0, err
    assert 'trackers = [\n    "tensorboard",\n]' in out or 'trackers = ["tensorboard"]' in out
    # an empty flag turns off the trackers the file selects
    code, out, err = run_main(
        ["train", "--dry-run", "--model", "mlp", "--config", str(job), "--trackers", ""], capsys
    )
    assert code == 0, err
    assert "trackers = []" in out


def test_trackers_without_a_run_directory_are_refused(job_factory: Any) -> None:
    """`train` called directly with no observe.out_dir: nowhere to write, so no silent drop."""
    job = job_factory(observe={"trackers": ["tensorboard"]})
    with pytest.raises(ConfigError, match="observe.out_dir is empty"):
        train(job)

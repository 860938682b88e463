"""Experiment trackers: ``metrics.jsonl``'s records mirrored to TensorBoard, MLflow or Weights &
Biases (`observe.trackers`), written by rank 0.

Each tracker is its package's own API behind the two methods of `Tracker`; `MetricsWriter`
hands it every record it writes. A record's numeric fields (`scalars`) become scalars named as
in ``metrics.jsonl`` (``loss``, ``lr``, ``step_time_s``, ``mfu``, ``val_loss``...) against the
record's ``step``; text (``strategy``) and flags (``skipped``) stay in the JSON lines.

[Note: optional tracker packages] The trackers' packages are optional extras (``pip install
'polytrain[tensorboard]'``, ``[mlflow]``, ``[wandb]``); mlflow takes about a second to import,
wandb half of one, and most jobs select none. So `import_tracker` imports them by name (``importlib``), when a
tracker is opened, like ``datasets`` in `polytrain.data.tables` ([Note: optional import]): the
places where polytrain imports an optional package at use. Pre-flight (`check_trackers`)
imports the selected ones in the launching process, so a missing package is one line naming
its extra before any worker starts.

[Note: one tracker run per training run] A worker restarted by the elastic agent (or a job
resumed into the same ``--out-dir``) reopens its trackers in the same run directory. MLflow and
W&B would start a second run there, splitting one training's curves; so the first open writes
its run's id to the run directory (``mlflow_run_id``, ``wandb_run_id``) and later opens continue
that run (MLflow: the same run id, back to RUNNING; W&B: ``resume="allow"`` with the same id).
TensorBoard needs nothing: its reader merges every event file of the directory.
"""

from __future__ import annotations

import importlib
import os
import secrets
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, get_args

from polytrain.config.job import TrackerName
from polytrain.errors import ConfigError

__all__ = [
    "MLflowTracker",
    "TensorBoardTracker",
    "Tracker",
    "WandbTracker",
    "check_trackers",
    "flatten",
    "import_tracker",
    "open_trackers",
    "scalars",
]

# tracker -> the module its class uses (torch's SummaryWriter needs the tensorboard package)
_MODULES: dict[TrackerName, str] = {
    "tensorboard": "torch.utils.tensorboard",
    "mlflow": "mlflow",
    "wandb": "wandb",
}

# MLflow refuses longer parameter values: 500 characters in mlflow 2.0, the oldest the extra
# allows (6000 in current releases). A job's values are short; a long one is cut, not refused.
_MLFLOW_PARAM_CHARS = 500


class Tracker(Protocol):
    """Where rank 0's records go besides ``metrics.jsonl``."""

    def log(self, record: Mapping[str, float], step: int) -> None:
        """One record's scalars (`scalars`) at training step ``step`` (1-based)."""

    def close(self, *, failed: bool = False) -> None:
        """Write what is buffered and end the run (``failed``: the training raised)."""


def import_tracker(name: TrackerName) -> ModuleType:
    """The module tracker ``name`` writes through ([Note: optional tracker packages]); a
    `ConfigError` naming the extra to install when it cannot be imported."""
    try:
        return importlib.import_module(_MODULES[name])
    except ImportError as exc:
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:120]
        raise ConfigError(
            f"observe.trackers includes {name!r}, whose package cannot be imported ({reason}): "
            f"pip install 'polytrain[{name}]', or drop it from --trackers"
        ) from None


def check_trackers(names: Sequence[TrackerName]) -> None:
    """Pre-flight: every selected tracker's package imports."""
    for name in names:
        import_tracker(name)


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The numeric fields of a metrics record, ``step`` (the x axis) left out."""
    return {
        key: float(value)
        for key, value in record.items()
        if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)
    }


def flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 0.003}}`` -> ``{"optim.lr": 0.003}`` (a job as flat parameters)."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@contextmanager
def _env_default(name: str, value: str) -> Iterator[None]:
    """``os.environ[name]`` defaults to ``value`` inside the block only."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


def _read_id(path: Path) -> str:
    return path.read_text().strip() if path.is_file() else ""


def _write_id(path: Path, run_id: str) -> None:
    if _read_id(path) != run_id:
        path.write_text(run_id + "\n")


class TensorBoardTracker:
    """Event files under ``<run dir>/tensorboard`` (``tensorboard --logdir``) through torch's
    ``SummaryWriter``. Scalars are stored as float32 (TensorBoard's ``simple_value``)."""

    def __init__(self, run_dir: Path, job: Mapping[str, Any]) -> None:
        module = import_tracker("tensorboard")
        self._writer = module.SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, record: Mapping[str, float], step: int) -> None:
        for key, value in record.items():
            self._writer.add_scalar(key, value, global_step=step)
        # Written out per record, as metrics.jsonl is: a rank stopped by a signal keeps them.
        self._writer.flush()

    def close(self, *, failed: bool = False) -> None:
        self._writer.close()


class MLflowTracker:
    """An MLflow run named after the run directory, the job's fields as its parameters.

    The store is ``MLFLOW_TRACKING_URI`` when set (a server, a database), else a file store in
    ``<run dir>/mlruns`` (``mlflow ui --backend-store-uri <run dir>/mlruns``). MLflow 3 keeps the
    file store in maintenance mode and refuses it unless ``MLFLOW_ALLOW_FILE_STORE`` is set,
    so it is set while the client builds that default store (MLflow caches a store per URI),
    never left set in the process; its database store needs SQLAlchemy, which the light
    ``mlflow-skinny`` distribution leaves out. The experiment is ``MLFLOW_EXPERIMENT_NAME``
    (created if missing), else ``MLFLOW_EXPERIMENT_ID``, else MLflow's default one.
    """

    def __init__(self, run_dir: Path, job: Mapping[str, Any]) -> None:
        mlflow = import_tracker("mlflow")
        self._entities = mlflow.entities
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if uri:
            self._client = mlflow.MlflowClient(tracking_uri=uri)
        else:
            uri = (run_dir / "mlruns").resolve().as_uri()
            # the client builds its store once (MLflow caches it per URI): the opt-in is needed
            # only while it does, and is not left set in the caller's process
            with _env_default("MLFLOW_ALLOW_FILE_STORE", "true"):
                self._client = mlflow.MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if name:
            found = self._client.get_experiment_by_name(name)
            experiment = found.experiment_id if found else self._client.create_experiment(name)
        else:
            experiment = os.environ.get("MLFLOW_EXPERIMENT_ID", "0")
        # [Note: one tracker run per training run]
        id_file = run_dir / "mlflow_run_id"
        earlier = _read_id(id_file)
        if earlier and self._exists(earlier):
            self._run_id = earlier
            self._client.update_run(earlier, status="RUNNING")
            return  # its parameters were logged when it started
        self._run_id = self._client.create_run(experiment, run_name=run_dir.name).info.run_id
        _write_id(id_file, self._run_id)
        params = [
            self._entities.Param(key, str(value)[:_MLFLOW_PARAM_CHARS])
            for key, value in flatten(job).items()
        ]
        self._client.log_batch(self._run_id, params=params)  # the client sends them in chunks

    def _exists(self, run_id: str) -> bool:
        try:
            self._client.get_run(run_id)
        except Exception:  # MlflowException: not in this store (another tracking URI)
            return False
        return True

    def log(self, record: Mapping[str, float], step: int) -> None:
        now_ms = int(time.time() * 1000)
        metrics = [self._entities.Metric(k, v, now_ms, step) for k, v in record.items()]
        self._client.log_batch(self._run_id, metrics=metrics)

    def close(self, *, failed: bool = False) -> None:
        self._client.set_terminated(self._run_id, "FAILED" if failed else "FINISHED")


class WandbTracker:
    """A Weights & Biases run in ``<run dir>/wandb``, named after the run directory, the job as
    its config. Offline (``wandb sync`` uploads it later) unless ``WANDB_MODE`` says otherwise;
    the project is ``WANDB_PROJECT``, else ``polytrain``."""

    def __init__(self, run_dir: Path, job: Mapping[str, Any]) -> None:
        wandb = import_tracker("wandb")
        # [Note: one tracker run per training run]
        id_file = run_dir / "wandb_run_id"
        run_id = _read_id(id_file) or secrets.token_hex(6)  # W&B ids: [a-z0-9]
        _write_id(id_file, run_id)
        self._run = wandb.init(
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            name=run_dir.name,
            project=None if os.environ.get("WANDB_PROJECT") else "polytrain",
            mode=None if os.environ.get("WANDB_MODE") else "offline",
            config=dict(job),
            # Worker output already goes to the run's logs; W&B would wrap stdout again.
            settings=wandb.Settings(console="off"),
        )

    def log(self, record: Mapping[str, float], step: int) -> None:
        self._run.log(dict(record), step=step)

    def close(self, *, failed: bool = False) -> None:
        self._run.finish(exit_code=1 if failed else 0)


_CLASSES: dict[TrackerName, Callable[[Path, Mapping[str, Any]], Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "mlflow": MLflowTracker,
    "wandb": WandbTracker,
}
assert set(_MODULES) == set(_CLASSES) == set(get_args(TrackerName)), "a tracker half declared"


def open_trackers(
    names: Sequence[TrackerName], run_dir: Path, job: Mapping[str, Any]
) -> list[Tracker]:
    """The trackers ``names`` (`observe.trackers`) of the run in ``run_dir``; ``job`` is the job
    as a nested table (`config.base.to_dict`), logged as the run's parameters. Where one fails
    to open, those already open are closed as failed."""
    opened: list[Tracker] = []
    try:
        for name in names:
            opened.append(_CLASSES[name](run_dir, job))
    except BaseException:
        for tracker in opened:
            tracker.close(failed=True)
        raise
    return opened

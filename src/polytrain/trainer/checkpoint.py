"""Checkpoints that survive crashes, reshard across layouts, and load as tensors only.

[Note: checkpoint format] torch's DCP (``torch.distributed.checkpoint``) does two jobs: it
turns wrapped, sharded modules and optimizers into plain fully-qualified-name state dicts and
back (``get_state_dict`` / ``set_state_dict``, which know DDP, FSDP2 and DTensor), and it stores
them (``dcp.save`` / ``dcp.load`` with ``FileSystemWriter``). We use the first and not the second:
``FileSystemReader.read_metadata`` reads the ``.metadata`` file with ``pickle.load``, and DCP's
save/load planning exchanges pickled plans through ``gather_object`` / ``broadcast_object_list``.
Loading a checkpoint would run whatever the file (or a peer) says. So the state is gathered with
``get_state_dict(full_state_dict=True, flatten_optimizer_state_dict=True)`` — full, unsharded
tensors named by the unwrapped model's keys — and stored as safetensors (a JSON header plus raw
bytes) with a JSON manifest (trainer/manifest.py). Every rank writes a share: a tensor held by
several ranks (replicas, gathered shards) is written by one of them, chosen by hashing its key,
so the I/O spreads over the ranks. Resharding on load is then a matter of each rank reading the
full tensors of the keys it holds and handing them to ``set_state_dict``, which re-shards for
FSDP2 / DTensor. Any strategy whose ``modules`` are keyed ``blocks.<i>...`` (pipeline stages,
tensor-parallel shards, parameter-server replicas) is checkpointed and resharded by the same code.

[Note: checkpoint commit] A save writes into ``step_N.tmp/``. Each rank writes its file, hashes
it, and posts the file's name, size, sha256 and tensor list to the c10d store (bytes of JSON, no
collective, so it can run on a background thread). Rank 0 waits for every post, writes
``manifest.json`` last, fsyncs, and renames the directory to ``step_N/``. A crash at any point
leaves either no ``step_N/`` or a complete one; loading re-verifies every checksum.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes
from torch import nn

import polytrain
from polytrain.comm.agree import all_gather_ints, broadcast_int, differing_ranks, fingerprint
from polytrain.comm.kv import collect, publish
from polytrain.config.base import describe_field, to_dict
from polytrain.config.job import JobConfig
from polytrain.core.cadence import checkpoint_due
from polytrain.core.optim import lr_at
from polytrain.core.registry import StrategyFamily, family_for
from polytrain.core.strategy import NonFiniteLossError, Strategy
from polytrain.errors import CheckpointError, ConfigError
from polytrain.trainer.build import FAMILIES, strategy_family
from polytrain.trainer.manifest import (
    MANIFEST,
    Manifest,
    latest_valid,
    read_manifest,
    step_dir,
)
from polytrain.trainer.ownership import job_identity, owned, owned_by, prune

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

__all__ = ["Checkpointer", "check_same_job", "job_fingerprint", "restart_count"]

_PER_NODE = {"launch": ("node_rank",), "observe": ("out_dir", "progress", "trace")}


def restart_count() -> int:
    """How many times the elastic agent has restarted this worker group."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def job_fingerprint(job: JobConfig, world_size: int) -> str:
    """A digest of the job and layout, leaving out what may differ between nodes."""
    data = to_dict(job)
    for section, keys in _PER_NODE.items():
        for key in keys:
            data.get(section, {}).pop(key, None)
    data.get("checkpoint", {}).pop("resume", None)  # restarts resume implicitly
    text = json.dumps({"job": data, "world_size": world_size}, sort_keys=True, default=str)
    return f"{fingerprint(text):016x}"


def check_same_job(job: JobConfig, world_size: int) -> None:
    """Collective pre-flight: every rank must have been given the same job and layout."""
    differ = differing_ranks(int(job_fingerprint(job, world_size), 16))
    if differ:
        raise ConfigError(
            f"rank(s) {differ} were given a different job or layout than rank 0 (compared: "
            "every config field except launch.node_rank and observe.*): start every node "
            "with the same --config file and flags"
        )


def _options() -> StateDictOptions:
    """DCP's state-dict API is imported where it is called, not at the top: it brings FSDP and
    DTensor, which the launcher and a worker's start need not load ([Note: lazy
    torch.distributed])."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True)


def _warn(message: str) -> None:
    # stdout: rank 0's stdout reaches the user's terminal; its stderr goes to the run's logs.
    print(f"polytrain: warning: {message}", flush=True)


class _Parts:
    """The strategy's modules as one module, and the map between its keys and ours.

    One module is used as it is. Several (interleaved pipeline stages on one rank) are put in
    an ``nn.ModuleList`` so one ``get_state_dict`` call covers them and their optimizer; its
    ``<j>.`` prefix is stripped, since the modules' own keys (``blocks.<i>...``) are disjoint.
    """

    def __init__(self, strategy: Strategy) -> None:
        modules, optimizer = strategy.checkpoint_parts()
        self.multi = len(modules) > 1
        self.module: nn.Module = nn.ModuleList(modules) if len(modules) != 1 else modules[0]
        # A rank without model parts (a parameter server before it exposes its shard) has no
        # state of its own to save; an optimizer over parameters outside the modules cannot be
        # named, so it is left out too.
        self.optimizer = optimizer if modules else None

    def _strip(self, key: str) -> str:
        return key.split(".", 1)[1] if self.multi else key

    def _live(self) -> tuple[dict[str, Any], dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return dict(get_model_state_dict(self.module, options=_options())), {}
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer, options=_options())
        return dict(model_sd), dict(optim_sd)

    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Collective: the full (unsharded) state of this rank's parts under our keys
        (``model.<fqn>``, ``optim.<fqn>.<name>``), and its first parameter group's
        hyperparameters."""
        model_sd, optim_sd = self._live()
        flat = {"model." + self._strip(k): v for k, v in model_sd.items()}
        for fqn, entries in optim_sd.get("state", {}).items():
            for name, value in entries.items():
                flat[f"optim.{self._strip(fqn)}.{name}"] = value
        groups = optim_sd.get("param_groups", [])
        hyper = {k: v for k, v in groups[0].items() if k != "params"} if groups else {}
        return flat, hyper

    def load(self, fetch: Callable[[str, Any], Any]) -> None:
        """Collective: replace every live value ``v`` under our key ``k`` by ``fetch(k, v)``.

        The live optimizer keeps its own hyperparameters (the current job's)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if self.optimizer is not None:
            _init_optimizer_state(self.optimizer)
        model_sd, optim_sd = self._live()
        model_sd = {k: fetch("model." + self._strip(k), v) for k, v in model_sd.items()}
        if self.optimizer is None or not _has_tensor_state(optim_sd):
            # [Note: stateless optimizers] SGD without momentum keeps no tensor state; torch's
            # set_state_dict then finds no tensor to take a device from and fails ("Expected
            # device to be set"). There is nothing of the optimizer's to restore (its
            # hyperparameters are the current job's), so only the model is loaded.
            set_model_state_dict(self.module, model_sd, options=_options())
            return
        optim_sd["state"] = {
            fqn: {
                name: fetch(f"optim.{self._strip(fqn)}.{name}", value)
                for name, value in entries.items()
            }
            for fqn, entries in optim_sd["state"].items()
        }
        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict=model_sd,
            optim_state_dict=optim_sd,
            options=_options(),
        )


@torch.no_grad()
def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (one step with zero gradients and lr 0) if it has none.

    ``get_state_dict`` does this itself only when no parameter has a gradient; a parameter
    server's parameters always do (views of its flat gradient buffer), so without this its
    empty optimizer state would list no keys to load. The gradients are put back afterwards.
    """
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(p.grad is None for p in params):
        return  # get_state_dict initializes it
    grads = [p.grad for p in params]
    lrs = [group["lr"] for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    for p, g in zip(params, grads, strict=True):
        p.grad = g


def _has_tensor_state(optim_sd: dict[str, Any]) -> bool:
    """Whether an optimizer state dict holds any non-scalar tensor (see [Note: stateless
    optimizers])."""
    return any(
        isinstance(value, torch.Tensor) and value.dim() > 0
        for entries in optim_sd.get("state", {}).values()
        for value in entries.values()
    )


def _as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone().contiguous()
    return torch.tensor(value, dtype=torch.float64)  # e.g. a plain-number "step"


class Checkpointer:
    """Save, find and restore checkpoints for one rank of a job (see the Notes above)."""

    def __init__(self, job: JobConfig, strategy: Strategy, rank: int, world_size: int) -> None:
        self.job, self.strategy = job, strategy
        self.rank, self.world_size = rank, world_size
        self.root = Path(job.checkpoint.dir)
        if not strategy.checkpointable:  # declared by the strategy, with its reason
            raise CheckpointError(strategy.checkpoint_refusal)
        self.parts = _Parts(strategy)
        # A strategy whose default group carries point-to-point traffic on other threads (the
        # parameter server's receivers) gives a separate world group for our collectives.
        self.group = strategy.checkpoint_group
        self.refused: list[str] = []  # messages about checkpoints refused at restore (rank 0)
        self.last_saved = -1
        self.identity = job_identity(job)
        self._owners: dict[str, int] | None = None
        self._saves = 0
        self._pending: Future[None] | None = None
        self._executor = ThreadPoolExecutor(1) if job.checkpoint.async_save else None

    @staticmethod
    @contextlib.contextmanager
    def guard(checkpointer: Checkpointer | None) -> Iterator[None]:
        """Around the training loop: finish the save in flight; on a NaN stop, say what is kept."""
        if checkpointer is None:
            yield
            return
        try:
            yield
        except NonFiniteLossError as exc:
            with contextlib.suppress(Exception):
                checkpointer.wait()
            raise NonFiniteLossError(f"{exc}; {checkpointer.describe_last()}") from None
        checkpointer.close()

    def due(self, step: int) -> bool:
        """Whether to save after ``step`` optimizer steps (`core.cadence.checkpoint_due`)."""
        return checkpoint_due(self.job, step)

    def describe_last(self) -> str:
        if self.last_saved < 0:
            return f"no checkpoint was saved yet in {self.root}"
        path = step_dir(self.root, self.last_saved)
        return f"the last checkpoint, {path} (step {self.last_saved}), is intact"

    # ----------------------------------------------------------------------------- save
    def save(self, step: int) -> None:
        """Collective: checkpoint the state after ``step`` optimizer steps."""
        self.wait()  # one save in flight at a time
        self.strategy.before_save(step)  # e.g. a colocated server applies its last update
        state, hyper = self.parts.state()
        owners = self._owners_of(state)
        tensors = {k: _as_tensor(v) for k, v in state.items() if owners[k] == self.rank}
        tensors[f"rng.{self.rank}.cpu"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            tensors[f"rng.{self.rank}.cuda"] = torch.cuda.get_rng_state()
        self._saves += 1
        args = (step, tensors, hyper, self._saves)
        if self._executor is None:
            self._write(*args)
        else:
            self._pending = self._executor.submit(self._write, *args)
        self.last_saved = step

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; re-raise its error."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown()

    def _owners_of(self, state: dict[str, Any]) -> dict[str, int]:
        """Which rank writes each key (the same answer on every rank).

        The candidates for a key are the ranks that hold it; for a weight, only those that
        also hold its optimizer state when any do: the rank that updates a parameter holds its
        current value, where another rank may hold a stale copy (a parameter-server worker's
        replica lags the server's shard by one update). One candidate, picked by the key's
        hash, writes it, which spreads the writing over the ranks.
        """
        if self._owners is None:
            hashes = {fingerprint(k): k for k in state}
            updated = {
                fingerprint("updates:" + k[len("optim.") :].rsplit(".", 1)[0])
                for k in state
                if k.startswith("optim.")
            }
            gathered = all_gather_ints(sorted(hashes) + sorted(updated), group=self.group)
            holders: dict[int, list[int]] = {}
            for rank, values in enumerate(gathered):
                for h in values:
                    holders.setdefault(h, []).append(rank)
            owners = {}
            for h, key in hashes.items():
                candidates = holders[h]
                if key.startswith("model."):
                    updaters = holders.get(fingerprint("updates:" + key[len("model.") :]), [])
                    candidates = [r for r in candidates if r in updaters] or candidates
                owners[key] = candidates[h % len(candidates)]
            self._owners = owners
        return self._owners

    def _write(
        self, step: int, tensors: dict[str, torch.Tensor], hyper: dict[str, Any], serial: int
    ) -> None:
        tmp = step_dir(self.root, step).with_suffix(".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        name = f"rank_{self.rank:05d}.safetensors"
        blob = safetensors_bytes(tensors, metadata={"polytrain": polytrain.__version__})
        _write_durably(tmp / name, blob)
        post = {
            "file": name,
            "bytes": len(blob),
            "sha256": hashlib.sha256(blob).hexdigest(),
            "tensors": {k: [str(v.dtype), list(v.shape)] for k, v in tensors.items()},
        }
        publish(f"ckpt/{serial}/{self.rank}", json.dumps(post))
        if self.rank == 0:
            keys = [f"ckpt/{serial}/{r}" for r in range(self.world_size)]
            posts = [json.loads(v) for v in collect(keys, self.job.launch.timeout_s)]
            self._commit(step, tmp, posts, hyper)

    def _commit(
        self, step: int, tmp: Path, posts: list[dict[str, Any]], hyper: dict[str, Any]
    ) -> None:
        job, p = self.job, self.job.parallel
        manifest = Manifest(
            step=step,
            layout={
                "strategy": self.strategy.name,
                "family": strategy_family(job).name,
                "dp": p.dp,
                "tp": p.tp,
                "pp": p.pp,
                "zero": p.zero,
                "sync": p.sync,
                "world_size": self.world_size,
            },
            data={
                "position": step,
                "seed": job.train.seed,
                "global_batch_size": job.train.global_batch_size,
                "source": job.data.source,
            },
            lr_schedule={
                "schedule": job.optim.schedule,
                "step": step,
                "total_steps": job.train.steps,
                "next_lr": lr_at(step, job.optim, job.train.steps),
            },
            optimizer={"name": job.optim.name, "hyperparameters": _jsonable(hyper)},
            rng={
                "world_size": self.world_size,
                "keys": sorted(
                    k for post in posts for k in post["tensors"] if k.startswith("rng.")
                ),
            },
            versions={"torch": torch.__version__, "polytrain": polytrain.__version__},
            job_fingerprint=job_fingerprint(job, self.world_size),
            job=to_dict(job),
            job_identity=self.identity,
        )
        for post in posts:
            manifest.files[post["file"]] = {"sha256": post["sha256"], "bytes": post["bytes"]}
            for key, (dtype, shape) in post["tensors"].items():
                manifest.tensors[key] = {"file": post["file"], "dtype": dtype, "shape": shape}
        for stray in tmp.iterdir():  # files left by an earlier, crashed attempt at this step
            if stray.name not in manifest.files:
                stray.unlink()
        _write_durably(tmp / MANIFEST, manifest.to_json().encode())
        final = step_dir(self.root, step)
        if final.exists():  # a refused (corrupt) checkpoint of the same step, or our own
            if final not in {path for _, path in owned(self.root, self.identity)}:
                try:
                    read_manifest(final)
                    foreign = True
                except CheckpointError:
                    foreign = False
                if foreign:
                    raise CheckpointError(
                        f"{final} holds a valid checkpoint of another job: not replaced; use "
                        "another --checkpoint-dir ([Note: checkpoint ownership])"
                    )
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync_dir(self.root)
        prune(self.root, self.identity, self.job.checkpoint.keep)  # [Note: checkpoint ownership]
        for stale in self.root.glob("step_*.tmp"):  # left by saves that crashed
            if stale.name[5:-4].isdigit() and int(stale.name[5:-4]) <= step:
                shutil.rmtree(stale, ignore_errors=True)

    # -------------------------------------------------------------------------- restore
    def restore(self) -> int:
        """Collective: load the newest valid checkpoint; return its step (0 if none)."""
        chosen = -1
        if self.rank == 0:
            owner = None if self.job.checkpoint.adopt else owned_by(self.identity)
            found, self.refused = latest_valid(self.root, owner)
            for message in self.refused:
                _warn(f"refusing checkpoint: {message}; falling back to an older one")
            if found is None:
                _warn(f"no valid checkpoint in {self.root}: starting from step 0")
            else:
                chosen = found[1].step
                # The same job ([Note: checkpoint ownership]) with settings that shape what
                # follows (the step count stretches the learning-rate schedule).
                for difference in _job_differences(found[1].job, to_dict(self.job)):
                    _warn(f"checkpoint step {chosen} was saved with other settings: {difference}")
        step = broadcast_int(chosen, group=self.group)
        if step < 0:
            return 0
        path = step_dir(self.root, step)
        manifest = Manifest.from_json((path / MANIFEST).read_text(), str(path / MANIFEST))
        _check_state_carries_over(manifest.job, manifest.layout.get("family"), self.job, path)
        with _Files(path) as files:

            def fetch(key: str, live: Any) -> Any:
                info = manifest.tensors.get(key)
                if info is None:
                    raise CheckpointError(
                        f"{path} has no tensor {key!r}: it was saved from a different model "
                        "or optimizer; use a matching job or another --checkpoint-dir"
                    )
                return _like(files.get(info["file"], key), live, key, path)

            self.parts.load(fetch)
            rng = files.get_optional(manifest, f"rng.{self.rank}.cpu")
            rng_cuda = files.get_optional(manifest, f"rng.{self.rank}.cuda")
        if manifest.rng.get("world_size") == self.world_size:
            if rng is not None:
                torch.set_rng_state(rng)
            if rng_cuda is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng_cuda)
        self.last_saved = step
        self.strategy.resume_at(step)  # e.g. parameter servers restart their clocks here
        if self.rank == 0:
            print(f"polytrain: resumed from {path} (step {step})", flush=True)
        return step


class _Files:
    """Open safetensors files of one checkpoint lazily (tensors only, never code)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.handles: dict[str, Any] = {}

    def __enter__(self) -> _Files:
        return self

    def __exit__(self, *exc: object) -> None:
        self.handles.clear()

    def get(self, file: str, key: str) -> torch.Tensor:
        if file not in self.handles:
            self.handles[file] = safe_open(str(self.path / file), framework="pt")
        tensor: torch.Tensor = self.handles[file].get_tensor(key)
        return tensor

    def get_optional(self, manifest: Manifest, key: str) -> torch.Tensor | None:
        info = manifest.tensors.get(key)
        return None if info is None else self.get(info["file"], key)


def _like(tensor: torch.Tensor, live: Any, key: str, path: Path) -> Any:
    """``tensor`` in the form of the live value it replaces (shape checked)."""
    if not isinstance(live, torch.Tensor):
        return type(live)(tensor.item())
    if tuple(tensor.shape) != tuple(live.shape):
        raise CheckpointError(
            f"{path}: {key!r} has shape {tuple(tensor.shape)}, the model needs "
            f"{tuple(live.shape)}: the checkpoint is from a different model size"
        )
    return tensor.to(dtype=live.dtype, device=live.device)


_TRAJECTORY = ("model", "data", "optim", "train")  # what a resumed run's trajectory depends on


def _check_state_carries_over(
    saved: dict[str, Any],
    saved_family: str | None,
    job: JobConfig,
    path: Path,
    families: tuple[StrategyFamily, ...] = FAMILIES,
) -> None:
    """Refuse a resume that would drop state the checkpoint holds beyond the model and its
    optimizer, or start that state afresh as if it had been saved: each family declares the
    settings that state depends on (``StrategyFamily.state_settings``), and those of the saving
    and the resuming job's families are compared. A job of another family holds no such state,
    so counts as the setting's default. Every rank reads the same manifest, so every rank
    refuses alike. ``saved_family`` is None for a checkpoint that did not record it."""
    current = family_for(job, families)
    saved_family = saved_family or current.name  # unrecorded: assume the job's own
    now = to_dict(job)
    for family in families:
        for key, state in family.state_settings.items():
            default = describe_field(JobConfig, key).default
            old = _lookup(saved, key, default) if family.name == saved_family else default
            new = _lookup(now, key, default) if family is current else default
            if old != new:
                raise CheckpointError(
                    f"{path} was saved with {key} = {old!r} and this job has {new!r}: {state} "
                    f"cannot carry over; resume with --set {key}={old} or start from another "
                    "--checkpoint-dir"
                )


def _lookup(job: dict[str, Any], key: str, default: Any) -> Any:
    """The value at dotted ``key`` of a job's plain dict (``default`` where it is absent)."""
    value: Any = job
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return default
        value = value[part]
    return value


def _job_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``section.key = saved -> current`` for the fields that shape the training trajectory."""
    out = []
    for section in _TRAJECTORY:
        old, new = saved.get(section, {}), current.get(section, {})
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                out.append(f"{section}.{key} = {old.get(key)!r} -> {new.get(key)!r}")
    return out


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in values.items():
        if isinstance(v, torch.Tensor):
            v = v.tolist()
        out[k] = (
            v if isinstance(v, bool | int | float | str | list | tuple | type(None)) else str(v)
        )
    return out


def _write_durably(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

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
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

import polytrain
from polytrain.comm.agree import all_gather_ints, broadcast_int, fingerprint
from polytrain.comm.kv import collect, publish
from polytrain.config.base import to_dict
from polytrain.config.job import JobConfig
from polytrain.core.cadence import checkpoint_due
from polytrain.core.optim import lr_at
from polytrain.core.strategy import NonFiniteLossError, Strategy
from polytrain.errors import CheckpointError
from polytrain.trainer.build import strategy_family
from polytrain.trainer.checkpoint_state import CheckpointParts
from polytrain.trainer.manifest import (
    MANIFEST,
    Manifest,
    latest_valid,
    read_manifest,
    step_dir,
)
from polytrain.trainer.ownership import job_identity, owned, owned_by, prune
from polytrain.trainer.resume_checks import (
    check_state_carries_over,
    job_differences,
    job_fingerprint,
)

__all__ = ["Checkpointer", "restart_count"]


def restart_count() -> int:
    """How many times the elastic agent has restarted this worker group."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _warn(message: str) -> None:
    # stdout: rank 0's stdout reaches the user's terminal; its stderr goes to the run's logs.
    print(f"polytrain: warning: {message}", flush=True)


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
        self.parts = CheckpointParts(strategy)
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
                for difference in job_differences(found[1].job, to_dict(self.job)):
                    _warn(f"checkpoint step {chosen} was saved with other settings: {difference}")
        step = broadcast_int(chosen, group=self.group)
        if step < 0:
            return 0
        path = step_dir(self.root, step)
        manifest = Manifest.from_json((path / MANIFEST).read_text(), str(path / MANIFEST))
        check_state_carries_over(manifest.job, manifest.layout.get("family"), self.job, path)
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

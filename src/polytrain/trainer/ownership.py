"""Which job owns a checkpoint directory, and what a job may do with one it does not own.

[Note: checkpoint ownership] A checkpoint's manifest records ``job_identity``: a digest of what
makes two runs the same job, i.e. the fields that decide what the saved state *is* (model, data,
optimizer kind, global batch, seed). Left out: the layout (a job resumes under another one), the
step count, the LR schedule and optimizer hyperparameters (a resumed job may change them; the
loader warns), and output paths. Rules, checked in pre-flight before any worker starts
(`check_checkpoint_dir`) and kept by the workers:

- a fresh run (no ``--resume``) refuses a directory that holds any valid checkpoint: it would
  start from step 0 and its saves and pruning would replace what is there;
- ``--resume`` refuses a directory holding another job's checkpoints unless
  ``checkpoint.adopt = true``, which lets it resume from the newest valid one whoever wrote it
  (fine-tuning on other data, say);
- ``--resume`` of a checkpoint whose step is already ``>= train.steps`` is refused with the fix
  (raise ``--steps``) instead of a run with nothing to do;
- pruning (`prune`) deletes only this job's own valid checkpoints beyond the newest
  ``checkpoint.keep``; another job's, and directories that do not verify (``step_999999999999``
  without a manifest), are never deleted and never hold a keep slot.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from polytrain.comm.agree import fingerprint
from polytrain.config.base import to_dict
from polytrain.config.job import JobConfig
from polytrain.errors import CheckpointError, ConfigError
from polytrain.trainer.manifest import Manifest, committed, latest_valid, read_manifest

__all__ = [
    "IDENTITY_FIELDS",
    "check_checkpoint_dir",
    "identity_of",
    "job_identity",
    "manifest_identity",
    "newest_checkpoint_note",
    "owned",
    "owned_by",
    "prune",
]

# section -> fields (None: the whole section) that make two runs the same job.
IDENTITY_FIELDS: dict[str, tuple[str, ...] | None] = {
    "model": None,
    "data": None,
    "optim": ("name",),
    "train": ("global_batch_size", "seed"),
}


def _identity_view(job: dict[str, Any]) -> dict[str, Any]:
    view: dict[str, Any] = {}
    for section, keys in IDENTITY_FIELDS.items():
        values = job.get(section, {})
        view[section] = values if keys is None else {k: values.get(k) for k in keys}
    return view


def identity_of(job: dict[str, Any]) -> str:
    """The identity digest of a job given as a plain dict (`to_dict` of a `JobConfig`)."""
    text = json.dumps(_identity_view(job), sort_keys=True, default=str)
    return f"{fingerprint(text):016x}"


def job_identity(job: JobConfig) -> str:
    """The digest recorded as ``job_identity`` in every manifest ([Note: checkpoint ownership])."""
    return identity_of(to_dict(job))


def manifest_identity(manifest: Manifest) -> str:
    """Who owns a checkpoint: its recorded identity, or (a manifest written before the field
    existed) the identity of the job config it also records."""
    return manifest.job_identity or identity_of(manifest.job)


def _first_difference(saved: dict[str, Any], current: dict[str, Any]) -> str:
    old, new = _identity_view(saved), _identity_view(current)
    for section in IDENTITY_FIELDS:
        for key in sorted(set(old[section]) | set(new[section])):
            if old[section].get(key) != new[section].get(key):
                was, now = old[section].get(key), new[section].get(key)
                return f"{section}.{key} = {was!r} there, {now!r} here"
    return "the job identity differs"


def owned_by(identity: str) -> Callable[[Manifest], bool]:
    """A `latest_valid` filter: checkpoints of the job with this identity."""
    return lambda manifest: manifest_identity(manifest) == identity


def owned(root: str | Path, identity: str) -> list[tuple[int, Path]]:
    """This job's checkpoints under ``root`` whose manifest checks out, newest first."""
    mine = []
    for step, path in committed(root):
        try:
            manifest = read_manifest(path)
        except CheckpointError:
            continue
        if manifest_identity(manifest) == identity:
            mine.append((step, path))
    return mine


def prune(root: str | Path, identity: str, keep: int) -> None:
    """Delete this job's valid checkpoints beyond the newest ``keep`` ([Note: checkpoint
    ownership]); nothing else under ``root`` is touched."""
    for _, old in owned(root, identity)[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def _valid(root: Path) -> list[Manifest]:
    found = []
    for _, path in committed(root):
        try:
            found.append(read_manifest(path))
        except CheckpointError:
            continue
    return found


def check_checkpoint_dir(job: JobConfig) -> None:
    """Pre-flight: refuse a checkpoint directory this job must not write or resume from."""
    ck = job.checkpoint
    if not ck.dir:
        return
    root = Path(ck.dir)
    manifests = _valid(root) if root.is_dir() else []
    if not manifests:
        return
    newest = manifests[0]
    if not ck.resume:
        raise ConfigError(
            f"checkpoint.dir = {ck.dir!r} already holds checkpoints (newest: step "
            f"{newest.step}): pass --resume to continue from it, or choose another "
            "--checkpoint-dir (a fresh run would replace them)"
        )
    identity = job_identity(job)
    foreign = [m for m in manifests if manifest_identity(m) != identity]
    if foreign and not ck.adopt:
        other = foreign[0]
        raise ConfigError(
            f"checkpoint.dir = {ck.dir!r} holds checkpoints of another job (step {other.step}: "
            f"{_first_difference(other.job, to_dict(job))}): choose another --checkpoint-dir, "
            "or set checkpoint.adopt = true (--set checkpoint.adopt=true) to resume from them"
        )
    found, _ = latest_valid(root, None if ck.adopt else owned_by(identity))
    if found is not None and found[1].step >= job.train.steps:
        step = found[1].step
        raise ConfigError(
            f"checkpoint.dir = {ck.dir!r}: its newest valid checkpoint is at step {step} and "
            f"train.steps = {job.train.steps}: nothing to do; raise --steps above {step} to "
            "train further"
        )


def newest_checkpoint_note(job: JobConfig) -> str:
    """Where a stopped run can resume from: its newest valid checkpoint, or that it has none."""
    if not job.checkpoint.dir:
        return "no checkpoints (no --checkpoint-dir)"
    owner = None if job.checkpoint.adopt else owned_by(job_identity(job))
    found, _ = latest_valid(job.checkpoint.dir, owner)
    if found is None:
        return f"no valid checkpoint in {job.checkpoint.dir} yet"
    path, manifest = found
    return f"newest valid checkpoint: {path} (step {manifest.step}); continue with --resume"

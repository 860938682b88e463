"""TOML load and save of `JobConfig`, and ``section.key=value`` overrides from the CLI."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import tomli_w

from polytrain._toml import tomllib
from polytrain.config.base import from_dict, to_dict
from polytrain.config.job import JobConfig
from polytrain.errors import ConfigError

__all__ = ["job_from_dict", "job_from_fields", "load_job", "merge", "parse_override", "save_job"]


def job_from_dict(data: dict[str, Any]) -> JobConfig:
    return from_dict(JobConfig, data)


def job_from_fields(fields: dict[str, Any]) -> JobConfig:
    """The job of dotted keys (``{"model.name": "mlp", "train.steps": 5}``), defaults elsewhere."""
    data: dict[str, Any] = {}
    for key, value in fields.items():
        merge(data, key.split("."), value)
    return job_from_dict(data)


def load_job(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a TOML job file as a plain dict (validated later, after overrides are merged)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist: check the path")
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {exc}") from None


def save_job(job: JobConfig, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
    p = Path(path)
    if p.exists() and not overwrite:
        raise ConfigError(f"{str(p)!r} already exists: choose another path or remove it")
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(tomli_w.dumps(to_dict(job)))
    tmp.replace(p)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'optim.lr=0.01'`` -> (['optim', 'lr'], 0.01); the value is parsed as TOML, else a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} is not of the form section.key=value")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.strip().split("."), value


def merge(base: dict[str, Any], path: list[str], value: Any) -> None:
    """Set ``base[path[0]][path[1]]... = value``, creating tables on the way."""
    node = base
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path)}: {part!r} is a value, not a section")
        node = child
    node[path[-1]] = value

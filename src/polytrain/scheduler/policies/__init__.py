"""The scheduling policies by name: one module per policy, one registry row each.

Every policy is a frozen dataclass with a ``name`` and a pure ``decide(jobs, cluster, now)``
(:class:`~polytrain.scheduler.policy.Policy`); its options are its fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from polytrain.errors import ConfigError
from polytrain.scheduler.policies.fifo import Fifo
from polytrain.scheduler.policies.gandiva import Gandiva
from polytrain.scheduler.policies.goodput import Goodput
from polytrain.scheduler.policies.srtf import Srtf
from polytrain.scheduler.policies.tiresias import Tiresias
from polytrain.scheduler.policy import Policy

__all__ = ["POLICIES", "Fifo", "Gandiva", "Goodput", "Srtf", "Tiresias", "get_policy"]

POLICIES: dict[str, Callable[..., Policy]] = {
    "fifo": Fifo,
    "srtf": Srtf,
    "tiresias": Tiresias,
    "gandiva": Gandiva,
    "goodput": Goodput,
}


def get_policy(name: str, **options: Any) -> Policy:
    """The policy called ``name`` with ``options`` (its fields); one line naming what is wrong."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ConfigError(f"unknown policy {name!r}: choose one of {', '.join(POLICIES)}")
    fields = {f.name for f in dataclasses.fields(factory)} - {"name"}  # type: ignore[arg-type]
    unknown = sorted(set(options) - fields)
    if unknown:
        known = ", ".join(sorted(fields)) or "none"
        raise ConfigError(f"policy {name!r} has no option {unknown[0]!r} (its options: {known})")
    return factory(**options)

"""Ask whether an object is a DTensor or an FSDP2 module without importing either package.

[Note: lazy torch.distributed] ``torch.distributed.fsdp``, ``torch.distributed.tensor`` and
``torch.distributed.checkpoint`` take about a second of CPU to import on a small machine, and
the launcher (``polytrain train``, whose CLI imports every strategy family) and a worker's
start-up need none of them. So polytrain imports them only where a strategy builds on them:
inside the function that calls them, and under ``TYPE_CHECKING`` for annotations. Code that
only needs to tell their objects apart asks here: an object cannot be an instance of a class
whose module was never imported (torch imports a package before any of its submodules), so the
answer is False without importing anything. ``tests/unit/test_lazy_dist.py`` keeps the worker's
and the launcher's imports free of the three packages. A worker still loads them once it builds
its optimizer: a torch optimizer imports ``torch._dynamo`` on first use, which imports FSDP
(torch's cost, paid once per process; the test harness's fork server preloads it).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

__all__ = ["is_dtensor", "is_fsdp_module", "local_tensor"]


def _loaded_class(module: str, name: str) -> type | None:
    """``module.name`` if ``module`` is imported (and done defining ``name``), else None."""
    cls = getattr(sys.modules.get(module), name, None)
    return cls if isinstance(cls, type) else None


def is_dtensor(x: object) -> TypeGuard[DTensor]:
    """Whether ``x`` is a DTensor (False, without importing DTensor, when no DTensor exists)."""
    cls = _loaded_class("torch.distributed.tensor", "DTensor")
    return cls is not None and isinstance(x, cls)


def is_fsdp_module(x: object) -> TypeGuard[FSDPModule]:
    """Whether ``x`` is a module that FSDP2's ``fully_shard`` or ``replicate`` wrapped."""
    cls = _loaded_class("torch.distributed.fsdp", "FSDPModule")
    return cls is not None and isinstance(x, cls)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a view sharing storage) if it is a DTensor, else ``t``."""
    return t.to_local() if is_dtensor(t) else t

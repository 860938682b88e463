"""Count where polytrain's own code reads a tensor on the host, step by step.

A read (``item``, ``float``, ``int``, ``bool``, ``tolist``, ``cpu``, ``numpy``) of a device
tensor makes the host wait for the device; inside a training step on a GPU that costs the
queue of work the host would otherwise have built ahead (STYLE 21, [Note: the step stays on the
device] in `polytrain.core.step`). `HostReads` is a ``TorchFunctionMode`` that sees every such
call, keeps those whose caller is a polytrain module (torch's own internals are not ours to
count), and files each under the step the loop is in (`HostReads.step`). It works on the CPU,
where every tensor is a host tensor, so CI checks the GPU's rule without a GPU.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.overrides import TorchFunctionMode

__all__ = ["READS", "HostReads"]

# The Tensor methods that hand a value to Python (or move it to the host).
READS = frozenset(
    {"item", "__float__", "__int__", "__index__", "__bool__", "tolist", "cpu", "numpy"}
)

_PACKAGE = Path(__file__).resolve().parents[1]  # src/polytrain
_SELF = Path(__file__).resolve()


class HostReads(TorchFunctionMode):
    """While active: ``reads[step]`` lists ``"<method> <file>:<line>"`` for every read made by
    polytrain's code (outside this module) while ``step`` was the current step (-1 before the
    first)."""

    def __init__(self) -> None:
        super().__init__()
        self.step = -1
        self.reads: dict[int, list[str]] = defaultdict(list)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = getattr(func, "__name__", "")
        if name in READS:
            here = inspect.currentframe()
            caller = here.f_back if here is not None else None
            if caller is None:
                return func(*args, **(kwargs or {}))
            path = Path(caller.f_code.co_filename).resolve()
            if path != _SELF and path.is_relative_to(_PACKAGE):
                where = f"{path.relative_to(_PACKAGE)}:{caller.f_lineno}"
                self.reads[self.step].append(f"{name} {where}")
        return func(*args, **(kwargs or {}))

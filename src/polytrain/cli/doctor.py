"""``polytrain doctor``: versions, communication backends, devices and cores."""

from __future__ import annotations

import os
import platform

import torch
from rich.console import Console
from rich.table import Table

import polytrain
from polytrain.comm.init import available_backends

__all__ = ["doctor"]


def doctor() -> None:
    """Print versions, available c10d backends, devices and CPU cores."""
    table = Table(title="polytrain doctor", show_header=False)
    table.add_row("polytrain", polytrain.__version__)
    table.add_row("python", platform.python_version())
    table.add_row("torch", torch.__version__)
    table.add_row("c10d backends", ", ".join(available_backends()) or "none")
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        table.add_row("cuda devices", f"{len(names)}: " + ", ".join(names))
    else:
        table.add_row("cuda devices", "none (workers run on CPU with gloo)")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    table.add_row("cpu cores", f"{os.cpu_count()} ({usable} usable by this process)")
    table.add_row("default rendezvous", "127.0.0.1 (loopback only)")
    Console().print(table)

"""How many GPUs a job built in a test sees ([Note: device resolution]), whatever the machine."""

from __future__ import annotations

import pytest

from polytrain.config import devices


def see_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """Jobs built from now on in this test resolve devices as on a node with ``count`` GPUs."""
    monkeypatch.setattr(devices, "visible_gpus", lambda: count)

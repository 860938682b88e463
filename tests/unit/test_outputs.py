"""trainer.outputs.publish_new: a new file under the user's umask, never a replacement."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from polytrain.errors import OutputError
from polytrain.trainer.outputs import publish_new


def test_a_published_file_takes_the_umask_not_the_temporary_0600(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        out = publish_new(tmp_path / "w.safetensors", lambda tmp: tmp.write_bytes(b"x"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644  # as checkpoints are written


def test_an_existing_file_is_left_alone(tmp_path: Path) -> None:
    target = tmp_path / "w.safetensors"
    target.write_bytes(b"theirs")
    with pytest.raises(OutputError, match="was left alone"):
        publish_new(target, lambda tmp: tmp.write_bytes(b"ours"))
    assert target.read_bytes() == b"theirs"

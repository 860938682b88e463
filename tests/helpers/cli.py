"""The ``polytrain`` command run in-process, and the shape every bad-input answer must have."""

from __future__ import annotations

import pytest

from polytrain.cli.app import main


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``polytrain ARGV`` in this process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    captured = capsys.readouterr()
    return int(exc.value.code or 0), captured.out, captured.err


def assert_usage_error(code: int, err: str, expected: str) -> None:
    """Exit 2 and one line, ``polytrain: error: ...``, that names ``expected``."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("polytrain: error: "), lines[0]
    assert expected in lines[0], lines[0]

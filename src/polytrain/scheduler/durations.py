"""Durations as users type them on the scheduler's command lines: ``40m``, ``1h``, ``90s``, ``600``."""

from __future__ import annotations

import math
import re

from polytrain.errors import ConfigError

__all__ = ["parse_duration"]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|m|min|h|d)?\s*$")
_UNIT_S = {None: 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str, flag: str, *, allow_zero: bool = False) -> float:
    """Seconds in ``text`` (a number with an optional unit s, m, h, d); one line naming ``flag``."""
    match = _DURATION.match(text)
    seconds = float(match.group(1)) * _UNIT_S[match.group(2)] if match else math.nan
    if not (seconds > 0 or (allow_zero and seconds == 0)) or math.isinf(seconds):
        least = "zero or more" if allow_zero else "a positive duration"
        raise ConfigError(f"{flag} {text!r}: give {least} such as 40m, 1h, 90s or 600 (seconds)")
    return seconds

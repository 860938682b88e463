"""TOML reading on every Python polytrain supports: the standard ``tomllib`` from 3.11, its
backport ``tomli`` (a dependency only there) on 3.10."""

import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["tomllib"]

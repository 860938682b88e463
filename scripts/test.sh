#!/usr/bin/env bash
# Install what the tests need (CPU torch pinned first, so pip never resolves a CUDA build), then
# run ruff, mypy and the whole pytest suite. pytest's exit code 5 (no tests collected) fails.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check "torch==2.13.0"
python3 -m pip install -q --disable-pip-version-check -e ".[test]"
python3 -m ruff check src tests benchmarks
python3 -m ruff format --check src tests benchmarks
python3 -m mypy
set +e
python3 -m pytest -q -p no:cacheprovider --durations=30 "$@"
code=$?
set -e
if [ "$code" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$code"

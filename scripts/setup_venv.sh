#!/usr/bin/env bash
# Create or refresh .venv with moe-dispatch and its test extras. Sourced by test.sh and demo.sh.
# torch is pinned: an unpinned `pip install torch` can pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q torch==2.13.0 triton==3.6.0
.venv/bin/python -m pip install -q -e '.[test]'
# The linter CI runs first (scripts/test.sh); configured in pyproject.toml.
.venv/bin/python -m pip install -q ruff==0.16.9

#!/usr/bin/env bash
# Create or refresh .venv with moe-dispatch and its test extras. Sourced by test.sh and demo.sh.
# torch is pinned: an unpinned `pip install torch` can pull a multi-GB CUDA build.
# Everything installs in one pip run, so the resolver meets every pin at once (the test extra's
# numpy<2.4 among them) instead of a later install leaving an earlier one's choice in place.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
_venv_start=$SECONDS
_say() { echo "setup_venv [$((SECONDS - _venv_start)) s]: $*"; }
if [ ! -x .venv/bin/python ]; then
    _say "creating .venv with $("$PY" --version 2>&1); the first run then downloads and installs torch and the rest (a few minutes)"
    "$PY" -m venv .venv
fi
_say "upgrading pip in .venv"
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
_say "installing torch 2.13.0, triton 3.6.0, moe-dispatch (editable) with its test extras, ruff (minutes the first time, seconds once installed)"
# The linter CI runs first (scripts/test.sh); configured in pyproject.toml.
.venv/bin/python -m pip install -q torch==2.13.0 triton==3.6.0 -e '.[test]' ruff==0.16.9
_say "checking the installed requirements (pip check)"
.venv/bin/python -m pip check
_say ".venv ready"

#!/usr/bin/env bash
# Set up .venv (as scripts/test.sh does) and run the main job: the rank-consistency check.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q torch==2.13.0 triton==3.6.0
.venv/bin/python -m pip install -q -e '.[test]'
if .venv/bin/python -c "import moe_dispatch.check" 2>/dev/null; then
    exec .venv/bin/moe-dispatch check "$@"
fi
exec .venv/bin/python -m moe_dispatch.ops.demo "$@"

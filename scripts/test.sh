#!/usr/bin/env bash
# Create or refresh .venv, install moe-dispatch with its test extras, run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_venv.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"

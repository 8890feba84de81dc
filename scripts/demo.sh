#!/usr/bin/env bash
# Set up .venv (as scripts/test.sh does) and run the main job: the rank-consistency check.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_venv.sh
exec .venv/bin/moe-dispatch check "$@"

#!/usr/bin/env bash
# Set up .venv (as scripts/test.sh does) and run the main job: the rank-consistency check.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then
    echo "demo: refreshing .venv (seconds when it is up to date), then moe-dispatch check"
else
    echo "demo: building .venv first: torch, triton, megatron-core and the test tools (a few minutes, once), then moe-dispatch check"
fi
source scripts/setup_venv.sh
echo "demo: moe-dispatch check $* (its ranks start in tens of seconds on a few CPU cores; every row then prints as it runs)"
exec .venv/bin/moe-dispatch check "$@"

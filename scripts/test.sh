#!/usr/bin/env bash
# Create or refresh .venv, install moe-dispatch with its test extras, run pytest.
# Without arguments (CI): the whole suite under the main venv's megatron-core (0.16.1), then the
# Megatron integration tests under each further supported release (scripts/test_megatron_versions.sh),
# then the compile, row-stability and contract tests under the floor torch (scripts/test_floor_torch.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_venv.sh
.venv/bin/ruff check .
if [ $# -gt 0 ]; then
    exec .venv/bin/python -m pytest -q "$@"
fi
status=0
# Two workers, each file on one (its module-scoped spawns shared): the serial suite keeps about
# 0.7 of the 2 cores busy, two keep both busy.
# Two compiled-layer cases run once, in the floor torch's step below, not here as well: EP 4
# (four ranks compiling what two compile at EP 2) and dynamic=True (symbolic sizes from the first
# call, which the two-step aot_eager case here reaches on its second step by dynamo's automatic
# dynamic shapes; the costliest of the aot_eager cases).
.venv/bin/python -m pytest -q -n 2 --dist loadfile \
    --deselect "tests/test_layer_compile.py::test_compiled_layer_is_bitwise_eager[aot_eager-4-1-None]" \
    --deselect "tests/test_layer_compile.py::test_compiled_layer_is_bitwise_eager[aot_eager-2-2-True]" || status=$?
# The floor venv (a few GB of wheels) downloads and installs beside the Megatron releases' tests,
# which keep one core busy, not beside the main suite, which keeps both. A failed preparation is
# retried, and reported, by the floor step.
bash scripts/test_floor_torch.sh --prepare > .floor-prepare.log 2>&1 &
prepare=$!
MAIN_STATUS=$status bash scripts/test_megatron_versions.sh || status=1
wait $prepare || echo "floor torch: preparing .venv-floor beside the Megatron releases failed (retried below): $(tail -3 .floor-prepare.log)"
bash scripts/test_floor_torch.sh || status=1
exit $status

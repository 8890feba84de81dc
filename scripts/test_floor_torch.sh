#!/usr/bin/env bash
# The floor torch (README: torch 2.11+): the compile, row-stability and contract tests under
# torch 2.11.0 in .venv-floor, beside the main venv's pinned torch. Creates the venv, or fixes one
# left with another torch, triton, numpy or checkout; megatron-core is not needed there (PyPI's
# 2.11.0 Linux wheel is the CUDA build: a few GB, a minute to install, CPU is all the tests use).
# Usage: bash scripts/test_floor_torch.sh [pytest args, default: the floor tests below]
#        bash scripts/test_floor_torch.sh --prepare   (the venv only, no tests: test.sh runs this
#        beside the Megatron releases' tests, so the download and install overlap them)
set -uo pipefail
cd "$(dirname "$0")/.."
FLOOR_TORCH=2.11.0
TRITON=3.6.0
ROOT=$(pwd -P)
VENV=$ROOT/.venv-floor
TESTS=(tests/test_functions_compile.py tests/test_layer_compile.py tests/experts/test_row_stability.py
       tests/dispatcher/test_contract.py tests/router/test_router_gating.py tests/router/test_router_invariance.py
       tests/experts/test_fp8_weights.py)
# The compiled layer at EP 4 and with dynamic=True runs here only: test.sh's main suite leaves them out.
PREPARE=0
if [ "${1:-}" = "--prepare" ]; then PREPARE=1; shift; fi
[ $# -gt 0 ] && TESTS=("$@")
start=$SECONDS

state() {  # what .venv-floor has, as one line; run outside the checkout so that cwd cannot supply moe_dispatch
    (cd / && "$VENV/bin/python" -c "
import os, numpy, pytest, pytest_timeout, torch, triton, moe_dispatch
np_ok = tuple(int(p) for p in numpy.__version__.split('.')[:2]) < (2, 4)
print('torch', torch.__version__.split('+')[0], 'triton', triton.__version__, 'numpy<2.4', np_ok,
      'moe_dispatch', os.path.dirname(os.path.dirname(os.path.realpath(moe_dispatch.__file__))))
" 2>/dev/null)
}
want="torch $FLOOR_TORCH triton $TRITON numpy<2.4 True moe_dispatch $ROOT"
if [ -e "$VENV" ] && ! "$VENV/bin/python" -c "" 2>/dev/null; then
    rm -rf "$VENV"  # a venv whose interpreter is gone
fi
if [ "$(state)" != "$want" ]; then
    [ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV" || exit 1
    "$VENV/bin/python" -m pip install -q "torch==$FLOOR_TORCH" "triton==$TRITON" 'numpy<2.4' pytest pytest-timeout \
        && "$VENV/bin/python" -m pip install -q --no-deps -e . || { echo "floor torch: install failed" >&2; exit 1; }
fi
got=$(state)
if [ "$got" != "$want" ]; then
    echo "floor torch: $VENV has '$got', expected '$want'" >&2
    exit 1
fi
if [ "$PREPARE" = 1 ]; then
    echo "   floor torch $FLOOR_TORCH: .venv-floor ready ($((SECONDS - start)) s)"
    exit 0
fi
echo "== floor torch $FLOOR_TORCH (.venv-floor): pytest ${TESTS[*]}"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
status=$?
echo "   floor torch $FLOOR_TORCH: $([ $status -eq 0 ] && echo passed || echo failed) ($((SECONDS - start)) s)"
exit $status

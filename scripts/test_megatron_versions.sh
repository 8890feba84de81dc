#!/usr/bin/env bash
# The Megatron integration tests against every further supported megatron-core release, each
# installed beside the main venv (which has 0.16.1 and runs the whole suite), less those marked
# one_megatron_release (setup.cfg: they call no Megatron API that differs between releases, or
# repeat what a test run under every release covers; MEGATRON_SOURCE runs them all):
#   .venv-megatron/<version>, pip install --no-deps --ignore-requires-python --target
# (0.17+ declare Python >= 3.12; their MoE code runs on 3.11, and the main venv supplies torch,
# numpy and packaging). Prints which versions passed; exits nonzero if any failed.
# Usage: bash scripts/test_megatron_versions.sh            (after scripts/setup_venv.sh)
#   MEGATRON_VERSIONS="0.19.2" bash scripts/test_megatron_versions.sh
#   MAIN_STATUS=<exit status of the main suite>: reported beside the main venv's version.
#   MEGATRON_SOURCE=<a Megatron-LM checkout> bash scripts/test_megatron_versions.sh: also its
#     megatron/core (Megatron-LM HEAD has no wheel), with that checkout first on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
VERSIONS=${MEGATRON_VERSIONS-"0.17.0 0.18.0 0.19.2"}  # set but empty: no release
TESTS=(tests/integrations tests/dispatcher/test_megatron_reference.py)
RELEASE_TESTS=(-m "not one_megatron_release" "${TESTS[@]}")
PY=.venv/bin/python
version_of() {  # the megatron-core release that python imports with PYTHONPATH=$1 (local tag dropped)
    PYTHONPATH=$1 $PY -W ignore -c "from megatron.core import package_info; print(package_info.__version__)" \
        2>/dev/null | sed 's/+.*//'
}
passed=() failed=()
main=$(version_of "")
if [ -n "${MAIN_STATUS:-}" ]; then
    if [ "$MAIN_STATUS" -eq 0 ]; then passed+=("$main"); else failed+=("$main"); fi
fi
for v in $VERSIONS; do
    dir=$PWD/.venv-megatron/$v
    if [ "$(version_of "$dir")" != "$v" ]; then
        rm -rf "$dir"
        if ! $PY -m pip install -q --no-deps --ignore-requires-python --target "$dir" "megatron-core==$v"; then
            failed+=("$v(install)"); continue
        fi
    fi
    got=$(version_of "$dir")
    if [ "$got" != "$v" ]; then
        echo "megatron-core $v: PYTHONPATH=$dir imports $got" >&2; failed+=("$v"); continue
    fi
    echo "== megatron-core $v (PYTHONPATH=.venv-megatron/$v): ${RELEASE_TESTS[*]}"
    start=$SECONDS
    if PYTHONPATH=$dir $PY -m pytest -q -p no:cacheprovider "${RELEASE_TESTS[@]}"; then passed+=("$v"); else failed+=("$v"); fi
    echo "   ($((SECONDS - start)) s)"
done
if [ -n "${MEGATRON_SOURCE:-}" ]; then
    got=$(version_of "$MEGATRON_SOURCE")
    if [ ! -d "$MEGATRON_SOURCE/megatron/core" ] || [ -z "$got" ]; then
        echo "MEGATRON_SOURCE=$MEGATRON_SOURCE: no megatron.core imports from it" >&2; failed+=("source(import)")
    else
        echo "== megatron-core $got from source (PYTHONPATH=$MEGATRON_SOURCE): ${TESTS[*]}"
        start=$SECONDS
        if PYTHONPATH=$MEGATRON_SOURCE $PY -m pytest -q -p no:cacheprovider "${TESTS[@]}"; then
            passed+=("$got(source)"); else failed+=("$got(source)"); fi
        echo "   ($((SECONDS - start)) s)"
    fi
fi
echo "megatron-core versions passed: ${passed[*]:-none}; failed: ${failed[*]:-none}"
echo "megatron-core: ${#passed[@]} passed, ${#failed[@]} failed"
[ ${#failed[@]} -eq 0 ]

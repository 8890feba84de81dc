#!/usr/bin/env bash
# Megatron + TransformerEngine on the GPU machine, in few calls (the machine reaches no index).
# Before, on a machine with a package index: in .te/, TransformerEngine 2.20.2's core wheel (cp312,
# CUDA 13) split into five parts of at most 56 MiB (tewhl.part0..4) with its sha256, the
# meta-package and the Python packages TE imports in wheels/, the transformer_engine_torch sdist,
# and a build.sh that joins and installs them into /tmp/site and builds the extension against the
# GPU machine's torch; `bash scripts/megatron/prepare_trees.sh
# <Megatron-LM clone>` (.mlm/) and the cp312 megatron-core 0.19.2 wheel in .whl/. There: five calls
# that each carry one part and run `mkdir -p /tmp/te && cp .te/tewhl.partN /tmp/te/`, then
#
#   bash scripts/device_te.sh build     carry .te/wheels .te/build.sh .te/tewhl.sha256
#                                        .te/transformer_engine_torch-*.tar.gz .mlm .whl
#       builds TE into /tmp/site (about 150 s), installs megatron-core into /tmp/mc, times the EP-1
#       layers (ours, install() on Megatron + TE, stock Megatron + TE: bench_ep.py) and then, alone
#       on the GPU, the timed pretrain_gpt.py routes (ROUTES, default "head-te ckpt head-te-fp8")
#       while DEADLINE (s, default 555) allows; TIMED=0 builds only;
#   bash scripts/device_te.sh routes "G1" "G2" ...    carry .mlm .whl
#       each quoted group of pretrain_routes.sh routes as its own instance, side by side on the GPU
#       (their step times then mean nothing; their losses do); beside them, SANITIZE=1 runs
#       scripts/sanitize_ops.py under compute-sanitizer's memcheck, BITS_AGAINST=<checkout>
#       scripts/measure/layer_bits.py here and there (carry it), and GPU_TESTS="PATH ..." the GPU
#       tests of those paths (GPU_TESTS=1: all of tests/).
# Output under $OUT (default /tmp/out).
set -uo pipefail
cd "$(dirname "$0")/.."
DEADLINE=${DEADLINE:-555}
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
t0=$SECONDS
mode=${1:?usage: device_te.sh build | routes "GROUP" ...}; shift
install_mc() {
    [ -d /tmp/mc ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/mc \
        .whl/megatron_core-0.19.2-*.whl
}
case $mode in
build)
    date -u
    bash .te/build.sh 2>&1 | tail -4 | tee "$OUT/te_build.txt"
    echo "TE build: $((SECONDS - t0)) s"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    install_mc
    [ "${TIMED:-1}" = 1 ] || { echo "device_te.sh build: $((SECONDS - t0)) s"; exit 0; }
    PYTHONPATH=/tmp/site:/tmp/mc:$PWD timeout 170 torchrun --nproc-per-node 1 --master-port 29400 scripts/bench_ep.py \
        --what ep1 --ep1-layers ours,installed-te,stock-te 2>&1 | grep -v Warning | tee "$OUT/bench_te_layer.txt" | tail -20
    echo "bench: $((SECONDS - t0)) s"
    BUDGET=$((DEADLINE - (SECONDS - t0) - 110)) RUN_TIMEOUT=100 ROUTES="${ROUTES:-head-te ckpt head-te-fp8}" \
        bash scripts/megatron/pretrain_routes.sh 2>&1 | tail -60
    ;;
routes)
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    python3 -c "import transformer_engine.pytorch" 2>/dev/null || echo "no TE in /tmp/site: TE routes will fail"
    install_mc
    export ITERS=${ITERS:-12} RUN_TIMEOUT=${RUN_TIMEOUT:-140}
    i=0
    for group in "$@"; do
        i=$((i + 1))
        OUT=$OUT/r$i WORK=/tmp/routes$i PORT=$((29600 + 100 * i)) BUDGET=$((DEADLINE - RUN_TIMEOUT - 20)) ROUTES="$group" \
            bash scripts/megatron/pretrain_routes.sh > "$OUT/routes_$i.txt" 2>&1 &
    done
    if [ "${SANITIZE:-0}" = 1 ]; then
        PYTHONPATH=$PWD:$PYTHONPATH PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 200 compute-sanitizer --tool memcheck \
            --error-exitcode 3 python3 scripts/sanitize_ops.py --no-large > "$OUT/memcheck.log" 2>&1
        echo "memcheck rc $?"; grep -E "PASS|FAIL|ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -8
    fi
    if [ -n "${BITS_AGAINST:-}" ]; then
        for tree in "$PWD" "$BITS_AGAINST"; do
            PYTHONPATH=/tmp/site:$tree timeout 120 python3 scripts/measure/layer_bits.py > "$OUT/bits_$(basename "$tree").txt" 2>&1
        done
        diff "$OUT/bits_$(basename "$BITS_AGAINST").txt" "$OUT/bits_$(basename "$PWD").txt" > "$OUT/bits_diff.txt" \
            && echo "layer bits: the same as $BITS_AGAINST" || echo "layer bits: DIFFER (bits_diff.txt)"
    fi
    if [ "${GPU_TESTS:-0}" != 0 ]; then
        paths=$GPU_TESTS; [ "$paths" = 1 ] && paths=tests
        # shellcheck disable=SC2086  # PATH ... is a list
        PYTHONPATH=/tmp/site:/tmp/mc:$PWD timeout $((DEADLINE - 40 - (SECONDS - t0))) python3 -m pytest -q \
            -p no:cacheprovider -m gpu $paths > "$OUT/gpu_tests.log" 2>&1
        echo "gpu tests rc $?"; tail -15 "$OUT/gpu_tests.log"
    fi
    wait
    for f in "$OUT"/routes_*.txt; do echo "=== $f"; grep -A40 "^route " "$f"; done
    ;;
*) echo "unknown mode $mode: build | routes"; exit 2 ;;
esac
echo "device_te.sh $mode: $((SECONDS - t0)) s"

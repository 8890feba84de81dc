#!/usr/bin/env bash
# The FP8 work's device call (one H200, about 9 minutes): its GPU tests, the layer and GEMM
# benchmarks (with their launch sweeps), and compute-sanitizer over the ops, each under a time limit
# so that a slow part leaves the others' logs. Logs go to $OUT (default /tmp/out).
#   bash scripts/device_fp8.sh            (carry .whl/ with a cp312 megatron-core wheel for the
#                                          Megatron FP8 test; without it that test skips)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export OUT
tests="tests/experts/test_fp8.py tests/experts/test_fp8_weights.py tests/ops/test_fp8.py
       tests/ops/test_quantize_columns.py tests/test_layer_fp8.py tests/tools/test_capture.py
       tests/integrations/test_megatron_fp8.py"
timeout 200 bash scripts/device_run.sh "$(echo $tests)" ""
if [ -d /tmp/site ]; then export PYTHONPATH=/tmp/site:$PWD; else export PYTHONPATH=$PWD; fi
git log -1 --format='commit %H %cd' 2>/dev/null || true
timeout 220 python3 scripts/bench_fp8_layer.py ${LAYER_ARGS:-} 2>&1 | tee "$OUT/layer.log" | tail -170
timeout 80 python3 scripts/bench_fp8_gemm.py --ffn 1024 --counts ragged 2>&1 | tee "$OUT/gemm.log" | tail -40
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 90 compute-sanitizer --tool memcheck --error-exitcode 3 \
    python3 scripts/sanitize_ops.py --no-large > "$OUT/memcheck.log" 2>&1
echo "memcheck rc=$?" | tee -a "$OUT/memcheck.log"
tail -15 "$OUT/memcheck.log"

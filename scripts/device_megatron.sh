#!/usr/bin/env bash
# Megatron-core on the GPU machine (one H200; Python 3.12, torch 2.11, no megatron-core installed),
# under 0.16.1 and 0.19.2, in one device call (about 5-8 minutes):
#   1. `moe-dispatch check --megatron` at the report's shape (1024 tokens per rank, H 4096,
#      ffn 1024, E 64, K 6, bf16);
#   2. the GPU-marked integration tests (tests/integrations -m gpu);
#   3. the training run (scripts/train_moe_gpt.py) at EP 1, stock Megatron beside install()
#      (EP2=1: also at EP 2, two ranks sharing the GPU over gloo; the GPU tests run it small).
# Logs, SVGs and JSON go to $OUT (default /tmp/out).
#
# The wheels travel in .whl/ (gitignored: carry it), fetched on a machine with the registry:
#   for v in 0.16.1 0.19.2; do pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 -d .whl megatron-core==$v; done
# GPU_TESTS=0 skips step 2.
# Usage: bash scripts/device_megatron.sh [versions]     (default "0.16.1 0.19.2"; one version per
# call, e.g. `bash scripts/device_megatron.sh 0.19.2`, if a call must stay far below 10 minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
VERSIONS=${1:-"0.16.1 0.19.2"}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
git log -1 --format='commit %H %cd' 2>/dev/null || true
status=0
for v in $VERSIONS; do
    site=/tmp/mcore-$v
    wheel=$(ls .whl/megatron_core-"$v"-*.whl 2>/dev/null | head -1)
    if [ -z "$wheel" ]; then echo "no .whl/megatron_core-$v-*.whl"; status=1; continue; fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheel" || { status=1; continue; }
    export PYTHONPATH=$site:$PWD
    echo "=== megatron-core $(python3 -W ignore -c 'from megatron.core import package_info; print(package_info.__version__)' 2>/dev/null)"
    start=$SECONDS
    timeout 200 python3 -m moe_dispatch.tools.check --megatron --tokens 1024 --hidden 4096 --ffn 1024 --experts 64 \
        --topk 6 --dtype bf16 2>&1 | tee "$OUT/check_megatron_$v.log" | grep -v Warning | tail -45 || status=1
    echo "--- check: $((SECONDS - start)) s"; start=$SECONDS
    if [ "${GPU_TESTS:-1}" != 0 ]; then
        timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/integrations 2>&1 \
            | tee "$OUT/gpu_tests_$v.log" | tail -8 || status=1
        echo "--- gpu tests: $((SECONDS - start)) s"; start=$SECONDS
    fi
    timeout 150 python3 scripts/train_moe_gpt.py --ep-sizes 1 --stock --hidden 1024 --ffn 1024 --experts 16 --topk 4 \
        --heads 8 --vocab 4096 --seq 256 --batch 8 --svg "$OUT/train_loss_ep1_$v.svg" \
        --diff-svg "$OUT/train_diff_ep1_$v.svg" --json "$OUT/train_ep1_$v.json" \
        2>&1 | tee "$OUT/train_ep1_$v.log" | tail -30 || status=1
    echo "--- train EP 1: $((SECONDS - start)) s"; start=$SECONDS
    if [ -n "${EP2:-}" ]; then  # EP 2 on one GPU: two ranks over gloo (checks arithmetic, not NCCL speed)
        timeout 200 python3 scripts/train_moe_gpt.py --share-gpu 2 --ep-sizes 2 --stock --hidden 1024 --ffn 1024 \
            --experts 16 --topk 4 --heads 8 --vocab 4096 --seq 256 --batch 8 --steps 30 \
            --svg "$OUT/train_loss_ep2_$v.svg" --json "$OUT/train_ep2_$v.json" 2>&1 \
            | tee "$OUT/train_ep2_$v.log" | tail -20 || status=1
        echo "--- train EP 2 (shared GPU): $((SECONDS - start)) s"
    fi
done
exit $status

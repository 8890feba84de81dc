#!/usr/bin/env bash
# One device call: GPU tests and benchmarks. Usage on the GPU machine:
#   bash scripts/device_run.sh "<pytest paths>" "<bench commands separated by ;>"
# Megatron-core travels as a wheel in .whl/ (no network there).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD || exit 1
else
    export PYTHONPATH=$PWD
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
if [ -n "${1:-}" ]; then
    python3 -m pytest -q -p no:cacheprovider -m gpu $1 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if [ -n "${2:-}" ]; then
    bash -c "$2" 2>&1 | tee "$OUT/bench.log"
fi

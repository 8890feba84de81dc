#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py on one GPU with --mock-data, stock against ours through one flag,
#   --spec moe_dispatch.integrations.megatron deterministic_layer_spec
# at Megatron-LM HEAD and core_v0.19.0, with --transformer-impl transformer_engine (--moe-grouped-gemm
# --moe-permute-fusion: TEGroupedMLP experts) and local, both dispatchers for ours; dense and MoE
# layers mixed by --moe-layer-freq; TE's FP8 recipe on the dense layers; a checkpoint round trip.
#
# Run from the repository root on the GPU machine, TransformerEngine 2.20.2 already on PYTHONPATH (its
# torch extension built from the sdist, e.g. into /tmp/site), megatron-core NOT installed: .mlm/head and
# .mlm/v0.19 (megatron/, pretrain_gpt.py, gpt_builders.py, model_provider.py; gitignored, carried)
# provide `megatron`. Each run goes through scripts/megatron/run_pretrain.py, which runs
# pretrain_gpt.py unchanged and prints each step's exact loss.
#
#   bash scripts/megatron/pretrain_routes.sh
#   ROUTES="head-local v019-local head-te-fp8e4m3 head-te-again" bash scripts/megatron/pretrain_routes.sh
#
# ROUTES (in this order by default, most important first; a run starts only while less than BUDGET
# seconds have passed, so the whole call ends within about BUDGET + RUN_TIMEOUT + 20 s):
#   head-te      HEAD, TE, stock / ours alltoall / ours allgather
#   ckpt         HEAD, TE: stock saves at step 6, ours loads and saves, stock loads and saves;
#                compare_checkpoints.py compares the three (weights and optimizer state, bitwise)
#   v019-te      core_v0.19.0, TE, stock / ours alltoall / ours allgather
#   head-te-freq HEAD, TE, --moe-layer-freq [0,1,0,1]: ours alltoall / ours allgather / stock
#   head-te-fp8  HEAD, TE, --fp8-format hybrid --fp8-recipe tensorwise: ours a2a / ours ag / stock
#   head-local   HEAD, --transformer-impl local: stock / ours alltoall / ours allgather
#   v019-local   core_v0.19.0, local: stock / ours alltoall / ours allgather
#   v016-local   core_v0.16.1 (.mlm/v0.16), local, no --spec: stock, then ours alltoall / allgather
#                through docs/megatron.md's two-line edit of gpt_builders.py, applied to a copy by
#                scripts/megatron/edit_gpt_builders.py
# and on request:
#   head-te-fp8e4m3  TE FP8 recipe on the dense layers and our per-token FP8 in the MoE layers
#                    (deterministic_layer_spec_fp8), alltoall / allgather
#   head-te-again    HEAD, TE: ours alltoall and stock once more (run-to-run controls)
#   head-te-seq      HEAD, TE without --moe-grouped-gemm: SequentialMLP experts with TE's linears,
#                    stock / ours alltoall / ours allgather
# Env: ITERS (20), RUN_TIMEOUT (100 s per run), BUDGET (430 s), OUT (/tmp/out), PY (python3), WORK
# (/tmp/pretrain_routes) and PORT (29500, the first run's is PORT + 1): give two instances run side by
# side their own WORK and PORT (their step times then mean nothing; their losses still do).
# Output: $OUT/routes_report.txt (the table, also printed) and $OUT/routes_logs.txt (every run's log).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/pretrain_routes}; rm -rf "$WORK"; mkdir -p "$WORK/logs"
ITERS=${ITERS:-20}
RUN_TIMEOUT=${RUN_TIMEOUT:-100}
BUDGET=${BUDGET:-430}
PY=${PY:-python3}
ROUTES=${ROUTES:-"head-te ckpt v019-te head-te-freq head-te-fp8 head-local v019-local"}
export CUDA_DEVICE_MAX_CONNECTIONS=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 MASTER_ADDR=127.0.0.1 RANK=0 LOCAL_RANK=0 WORLD_SIZE=1
for tree in head v0.19; do
    [ -f ".mlm/$tree/pretrain_gpt.py" ] || { echo "no .mlm/$tree/pretrain_gpt.py: carry .mlm"; exit 1; }
done
case " $ROUTES " in *" v016-"*) [ -f .mlm/v0.16/pretrain_gpt.py ] || { echo "no .mlm/v0.16/pretrain_gpt.py"; exit 1; } ;; esac
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, transformer_engine; print('torch', torch.__version__, 'TE', transformer_engine.__version__)" \
    2>&1 | tail -1
echo "Megatron-LM: head $(cat .mlm/head/COMMIT 2>/dev/null), v0.19 $(cat .mlm/v0.19/COMMIT 2>/dev/null)," \
    "v0.16 $(cat .mlm/v0.16/COMMIT 2>/dev/null)"
git log -1 --format='moe-dispatch commit %H' 2>/dev/null || true

MODEL=(--mock-data --tokenizer-type NullTokenizer --vocab-size 4096 --num-layers 4 --hidden-size 1024
       --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 4
       --global-batch-size 16 --lr 3e-4 --num-experts 16 --moe-router-topk 2 --moe-ffn-hidden-size 1024
       --disable-bias-linear --bf16 --no-gradient-accumulation-fusion --attention-backend unfused
       --eval-iters 0 --eval-interval 1000 --log-interval 1 --seed 1234)
TE=(--transformer-impl transformer_engine --moe-grouped-gemm --moe-permute-fusion)
LOCAL=(--transformer-impl local --no-persist-layer-norm --no-masked-softmax-fusion)  # no apex kernels
OURS=(--spec moe_dispatch.integrations.megatron deterministic_layer_spec)
OURS_FP8=(--spec moe_dispatch.integrations.megatron deterministic_layer_spec_fp8)
A2A=(--moe-token-dispatcher-type alltoall)
AG=(--moe-token-dispatcher-type allgather)
FP8=(--fp8-format hybrid --fp8-recipe tensorwise)
FREQ=(--moe-layer-freq "[0,1,0,1]")
start_all=$SECONDS
port=${PORT:-29500}

run() {  # run NAME TREE [pretrain_gpt.py flags beyond MODEL]; TREE: under .mlm, or an absolute path
    local name=$1 tree=$2; shift 2
    local dir=$ROOT/.mlm/$tree
    case $tree in /*) dir=$tree ;; esac
    local spent=$((SECONDS - start_all))
    if [ "$spent" -gt "$BUDGET" ]; then
        echo "$name: skipped (${spent} s spent, BUDGET $BUDGET)"
        printf '%s\t%s\t%s\t%s\n' "$name" 125 0 "skipped" >> "$WORK/logs/routes.tsv"; return
    fi
    port=$((port + 1))
    local t0=$SECONDS
    (cd "$WORK" && MASTER_PORT=$port PYTHONPATH="$dir:$ROOT${PYTHONPATH:+:$PYTHONPATH}" \
        timeout -k 10 "$RUN_TIMEOUT" $PY "$ROOT/scripts/megatron/run_pretrain.py" "$dir/pretrain_gpt.py" \
        "${MODEL[@]}" "$@") > "$WORK/logs/$name.log" 2>&1
    local rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" $((SECONDS - t0)) "$tree $*" >> "$WORK/logs/routes.tsv"
    echo "$name: rc $rc, $((SECONDS - t0)) s, $(grep -c '^moe_dispatch_step' "$WORK/logs/$name.log") steps," \
        "install() logged: $(grep -c "moe_dispatch: install() on Megatron's MoELayer" "$WORK/logs/$name.log")"
    [ "$rc" -eq 0 ] || grep -E "Error|error" "$WORK/logs/$name.log" | tail -3
}

trio() {  # trio GROUP TREE [flags]: stock, ours alltoall, ours allgather
    local group=$1 tree=$2; shift 2
    run "$group.stock" "$tree" --train-iters "$ITERS" "$@" "${A2A[@]}"
    run "$group.ours-a2a" "$tree" --train-iters "$ITERS" "$@" "${A2A[@]}" "${OURS[@]}"
    run "$group.ours-ag" "$tree" --train-iters "$ITERS" "$@" "${AG[@]}" "${OURS[@]}"
}

checkpoint_round_trip() {
    local ck=$WORK/ckpt common=(--train-iters 6 --save-interval 1000 "${TE[@]}" "${A2A[@]}")
    run ckpt.stock-save head "${common[@]}" --save "$ck/stock"
    run ckpt.ours-load-save head "${common[@]}" "${OURS[@]}" --load "$ck/stock" --save "$ck/ours" \
        --exit-on-missing-checkpoint
    run ckpt.stock-load-save head "${common[@]}" --load "$ck/ours" --save "$ck/back" --exit-on-missing-checkpoint
    if [ -d "$ck/back" ]; then
        PYTHONPATH="$ROOT/.mlm/head:$ROOT${PYTHONPATH:+:$PYTHONPATH}" timeout 120 $PY scripts/megatron/compare_checkpoints.py \
            "$ck/stock" "$ck/ours" "$ck/back" > "$WORK/logs/checkpoint.txt" 2>&1
    else
        echo "no checkpoint from the last run (see ckpt.*.log)" > "$WORK/logs/checkpoint.txt"
    fi
    tail -3 "$WORK/logs/checkpoint.txt"
}

for route in $ROUTES; do
    case $route in
        head-te) trio head-te head "${TE[@]}" ;;
        ckpt) checkpoint_round_trip ;;
        v019-te) trio v019-te v0.19 "${TE[@]}" ;;
        head-te-freq)
            run head-te-freq.ours-a2a head --train-iters "$ITERS" "${TE[@]}" "${FREQ[@]}" "${A2A[@]}" "${OURS[@]}"
            run head-te-freq.ours-ag head --train-iters "$ITERS" "${TE[@]}" "${FREQ[@]}" "${AG[@]}" "${OURS[@]}"
            run head-te-freq.stock head --train-iters "$ITERS" "${TE[@]}" "${FREQ[@]}" "${A2A[@]}" ;;
        head-te-fp8)
            run head-te-fp8.ours-a2a head --train-iters "$ITERS" "${TE[@]}" "${FP8[@]}" "${A2A[@]}" "${OURS[@]}"
            run head-te-fp8.ours-ag head --train-iters "$ITERS" "${TE[@]}" "${FP8[@]}" "${AG[@]}" "${OURS[@]}"
            run head-te-fp8.stock head --train-iters "$ITERS" "${TE[@]}" "${FP8[@]}" "${A2A[@]}" ;;
        head-te-fp8e4m3)
            run head-te-fp8e4m3.ours-a2a head --train-iters "$ITERS" "${TE[@]}" "${FP8[@]}" "${A2A[@]}" "${OURS_FP8[@]}"
            run head-te-fp8e4m3.ours-ag head --train-iters "$ITERS" "${TE[@]}" "${FP8[@]}" "${AG[@]}" "${OURS_FP8[@]}" ;;
        head-local) trio head-local head "${LOCAL[@]}" ;;
        v019-local) trio v019-local v0.19 "${LOCAL[@]}" ;;
        v016-local)
            edited=$WORK/v0.16-edited
            rm -rf "$edited" && cp -r .mlm/v0.16 "$edited" && $PY scripts/megatron/edit_gpt_builders.py "$edited/gpt_builders.py"
            run v016-local.stock v0.16 --train-iters "$ITERS" "${LOCAL[@]}" "${A2A[@]}"
            run v016-local.ours-a2a "$edited" --train-iters "$ITERS" "${LOCAL[@]}" "${A2A[@]}"
            run v016-local.ours-ag "$edited" --train-iters "$ITERS" "${LOCAL[@]}" "${AG[@]}" ;;
        head-te-seq) trio head-te-seq head --transformer-impl transformer_engine --moe-permute-fusion ;;
        head-te-again)
            run head-te.ours-a2a-again head --train-iters "$ITERS" "${TE[@]}" "${A2A[@]}" "${OURS[@]}"
            run head-te.stock-again head --train-iters "$ITERS" "${TE[@]}" "${A2A[@]}" ;;
        *) echo "unknown route $route"; exit 2 ;;
    esac
done

for f in "$WORK"/logs/*.log; do  # without Megatron's dump of its arguments ("  name ...... value")
    echo "===== $(basename "$f" .log)"; grep -v -E "^\s*$|\.{6,}" "$f"
done > "$OUT/routes_logs.txt"
echo
$PY scripts/megatron/routes_report.py "$WORK/logs" --warmup 5 | tee "$OUT/routes_report.txt"
status=${PIPESTATUS[0]}
echo "total $((SECONDS - start_all)) s"
exit "$status"

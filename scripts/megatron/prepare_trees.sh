#!/usr/bin/env bash
# The Megatron-LM trees scripts/megatron/pretrain_routes.sh reads, from a clone of NVIDIA/Megatron-LM:
#   bash scripts/megatron/prepare_trees.sh PATH/TO/Megatron-LM[.git] [HEAD_COMMIT]
# Fills .mlm/head (HEAD_COMMIT, default the clone's HEAD), .mlm/v0.19 (core_v0.19.0) and .mlm/v0.16
# (core_v0.16.1), each with that commit's megatron/, pretrain_gpt.py, gpt_builders.py and
# model_provider.py and a COMMIT file, and builds Megatron's dataset helpers
# (megatron/core/datasets/helpers_cpp) for the GPU machine's Python (PYTHON, default python3.12;
# it needs pybind11), since the GPU machine's mock-data path imports them. About 32 MB in all, to
# carry in one device call (`carry: [".mlm"]`). /.mlm/ is in .gitignore.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=${1:?give the path of a Megatron-LM clone (a work tree or a bare git directory)}
head=${2:-$(git -C "$repo" rev-parse HEAD)}
PY=${PYTHON:-python3.12}
for spec in "head:$head" "v0.19:core_v0.19.0" "v0.16:core_v0.16.1"; do
    tree=${spec%%:*} ref=${spec#*:}
    rm -rf ".mlm/$tree" && mkdir -p ".mlm/$tree"
    files=()
    for f in megatron pretrain_gpt.py gpt_builders.py model_provider.py; do
        git -C "$repo" cat-file -e "$ref:$f" 2>/dev/null && files+=("$f")
    done
    git -C "$repo" archive "$ref" "${files[@]}" | tar -x -C ".mlm/$tree"
    git -C "$repo" rev-parse "$ref^{commit}" > ".mlm/$tree/COMMIT"
    (cd ".mlm/$tree/megatron/core/datasets" \
        && g++ -O3 -Wall -shared -std=c++11 -fPIC $("$PY" -m pybind11 --includes) helpers.cpp \
               -o "helpers_cpp$("$PY"-config --extension-suffix)")
    echo ".mlm/$tree: $(cat ".mlm/$tree/COMMIT") ($(du -sh ".mlm/$tree" | cut -f1))"
done

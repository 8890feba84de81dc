"""Local experts for expert parallelism: row-stable grouped and sequential MLPs.

See `moe_dispatch.experts.mlp` for the guarantees, `gemm` for the GEMM strategies and their
row-stability status, `activations` for why the CPU activations are hand-built, `fp8` for the
FP8 expert GEMMs (row-wise scales), `fp8_weights` for their weights quantised once per optimizer step,
`rows` for the record of the rows the experts take (``ExpertRows``), `wrappers` for the
forward's guards against a data-parallel wrapper that treats them as replicas, `source_grads` for the store of
their per-source weight gradients (``SourceGrads``, ``LocalExperts.collect_source_grads``).
"""

from .activations import activate, scale_rows
from .fp8 import fp8_expert_gemm, fp8_mlp, quantize_weight
from .fp8_weights import Fp8ExpertWeights, WeightStamp, quantize_fp8_weights, stamp_weights, weights_problem
from .gemm import expert_gemm, grouped_mm_row_stable, grouped_mm_supported, select_gemm
from .init import WEIGHT1, WEIGHT2, expert_seed, init_expert_weights, layer_seed
from .mlp import GroupedMLP, LocalExperts, SequentialMLP
from .rows import ExpertRows
from .source_grads import SourceGrads

__all__ = [
    "WEIGHT1",
    "WEIGHT2",
    "ExpertRows",
    "GroupedMLP",
    "LocalExperts",
    "SequentialMLP",
    "SourceGrads",
    "activate",
    "scale_rows",
    "expert_gemm",
    "fp8_expert_gemm",
    "fp8_mlp",
    "quantize_weight",
    "Fp8ExpertWeights",
    "quantize_fp8_weights",
    "WeightStamp",
    "stamp_weights",
    "weights_problem",
    "select_gemm",
    "grouped_mm_supported",
    "grouped_mm_row_stable",
    "expert_seed",
    "init_expert_weights",
    "layer_seed",
]

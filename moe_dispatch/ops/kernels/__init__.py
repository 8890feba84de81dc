"""Triton kernels, one module per kernel family, each kernel beside its launcher.

The permutation family: slot_rows.py (the ``slots`` layout, the rules, the shared helpers, the
zeros of uncovered rows), row_map.py (make_slots), permute.py (permute, its backward, the row
gather), unpermute.py (unpermute and its backward); quantize.py: float8 quantisation and
dequantisation; fingerprint.py: the bits fingerprint of
weights (ops.bits_fingerprint); float8.py: the float8 rounding both share
(also under ``TRITON_INTERPRET=1``); launch.py: the launch settings of every family.
Each launcher's pure-torch twin has its name in ``torch_twin.py``; this package's face offers the
same launcher names, so custom_ops picks either backend as one namespace. Importing it needs Triton.
"""
from .launch import LAUNCH, launch_settings
from .permute import gather_rows, permute_rows, permute_rows_backward
from .quantize import dequantize_rows, quantize_group_columns, quantize_rows
from .row_map import make_slots, make_slots_checked
from .slot_rows import zero_uncovered_rows
from .unpermute import unpermute_rows, unpermute_rows_backward

__all__ = ["LAUNCH", "dequantize_rows", "gather_rows", "launch_settings", "make_slots", "make_slots_checked",
           "permute_rows", "permute_rows_backward", "quantize_group_columns", "quantize_rows", "unpermute_rows",
           "unpermute_rows_backward", "zero_uncovered_rows"]

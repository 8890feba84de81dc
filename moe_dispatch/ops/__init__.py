"""Permutation ops: Triton kernels on CUDA and their pure-torch twins on CPU."""
from .custom_ops import bits_fingerprint, set_backend
from .fp8_rows import Fp8Rows
from .permutation import RowIdMap, check_device_errors, expert_row_counts, permute, sort_chunks, unpermute
from .quantize import dequantize_rows, quantize_group_columns, quantize_rows

__all__ = ["Fp8Rows", "RowIdMap", "bits_fingerprint", "check_device_errors", "dequantize_rows", "expert_row_counts",
           "permute", "quantize_group_columns", "quantize_rows", "set_backend", "sort_chunks", "unpermute"]

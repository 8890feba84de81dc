"""Permutation ops: Triton kernels on CUDA and their pure-torch twins on CPU."""
from .permutation import RowIdMap, check_device_errors, expert_row_counts, permute, set_backend, sort_chunks, unpermute

__all__ = ["RowIdMap", "check_device_errors", "expert_row_counts", "permute", "set_backend", "sort_chunks",
           "unpermute"]

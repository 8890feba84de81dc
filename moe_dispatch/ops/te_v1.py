"""TransformerEngine 1.x's MoE permutation functions (index maps only) over this package's kernels.

TE 1.x's ``moe_permute(inp, indices, num_out_tokens=-1, max_token_num=-1)`` took an index map
[T, K] of expert ids; TE 2.1 renamed the argument ``routing_map`` and made the mask map the
default, so 1.x code that passes an index tensor without ``map_type="index"`` reads it as a mask
under TE 2.x (on TE 2.20 an illegal memory access). With this module such code runs unchanged
but for its import line; ``moe_dispatch.ops.te`` has the 2.x signatures (and raises a clear error
for an index tensor passed as a mask).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import te

__all__ = ["moe_permute", "moe_unpermute"]


def moe_permute(inp: torch.Tensor, indices: torch.Tensor, num_out_tokens: int = -1,
                max_token_num: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """TE 1.x's moe_permute: ``te.moe_permute(..., map_type="index")``; num_out_tokens <= 0
    (the default -1) keeps every routed row. Returns (permuted [N, H], row_id_map int32 [T * K])."""
    if isinstance(num_out_tokens, int) and not isinstance(num_out_tokens, bool) and num_out_tokens < 0:
        num_out_tokens = 0
    return te.moe_permute(inp, indices, num_out_tokens, max_token_num, map_type="index")


def moe_unpermute(inp: torch.Tensor, row_id_map: torch.Tensor, probs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """TE 1.x's moe_unpermute: ``te.moe_unpermute(..., map_type="index")`` with probs [T, K]
    (None or an empty tensor: top-1, no weighting). Returns [T, H] in inp.dtype."""
    return te.moe_unpermute(inp, row_id_map, merging_probs=probs, map_type="index")

"""Forward exchange of the allgather dispatcher: every rank gathers all tokens, routing rows and
probs of the EP group (padded to the largest T), and keeps its own experts' columns. The rows then
follow exactly the alltoall order (source rank, token), so both dispatchers give identical rows.
"""
from __future__ import annotations

import torch

from .comm import all_gather_rows
from .common import DispatchHandle


@torch.no_grad()
def send_allgather(x: torch.Tensor, handle: DispatchHandle) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H] -> (tokens [P * Tmax, H], local routing [P * Tmax, El] bool, local probs
    [P * Tmax, El]); source s occupies rows [s * Tmax, s * Tmax + T_s), padding rows route nowhere.
    No autograd: the gradient path is ``common.expand``'s backward (no reduce-scatter)."""
    layout, probs, routing_map = handle.layout, handle.probs.detach(), handle.routing_map
    P, El, me = layout.ep_size, layout.num_local_experts, layout.rank
    if P == 1:
        return x, routing_map, probs
    T, E = routing_map.shape
    pad = max(layout.num_tokens) - T
    # Probs and the routing map travel together in the probs dtype (0/1 is exact in fp32/fp64).
    aux = torch.cat([probs, routing_map.to(probs.dtype)], dim=1)
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
        aux = torch.nn.functional.pad(aux, (0, 0, 0, pad))
    all_x = all_gather_rows(x, handle.group)
    all_aux = all_gather_rows(aux, handle.group)
    cols = slice(me * El, (me + 1) * El)
    return all_x, all_aux[:, E:][:, cols] != 0, all_aux[:, cols].contiguous()

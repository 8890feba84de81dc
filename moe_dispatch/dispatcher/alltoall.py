"""Forward exchange of the alltoall dispatcher: each token crosses the wire once per destination
rank that owns at least one of its experts (deduplicated), with its routing row and probs for that
rank's experts. The receiver expands the copies to one row per local expert (``common.expand``).
"""
from __future__ import annotations

import torch

from .comm import all_to_all_rows
from .common import DispatchHandle


def _copy_index(rank_map: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dest [n], token [n]) of the True entries of rank_map [T, P], destination-major then token
    ascending. `count` (known on the host) lets CUDA skip the size synchronisation of nonzero."""
    mask = rank_map.t()
    if mask.is_cuda and hasattr(torch, "nonzero_static"):
        idx = torch.nonzero_static(mask, size=count)
    else:
        idx = mask.nonzero()
    return idx[:, 0], idx[:, 1]


@torch.no_grad()
def send_alltoall(x: torch.Tensor, handle: DispatchHandle) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H] -> (tokens [R, H], local routing [R, El] bool, local probs [R, El]) received by this
    rank, grouped by source rank, tokens ascending within a source. No autograd: the gradient
    path is ``common.expand``'s backward."""
    layout, probs, routing_map = handle.layout, handle.probs.detach(), handle.routing_map
    P, El, me = layout.ep_size, layout.num_local_experts, layout.rank
    if P == 1:
        return x, routing_map, probs
    T = x.shape[0]
    local = routing_map.reshape(T, P, El)
    dest, token = _copy_index(local.any(-1), sum(layout.sent[me]))
    send_x = x.index_select(0, token)
    # Probs and routing rows travel together, both in the probs dtype (0/1 is exact in fp32/fp64).
    aux = torch.cat([probs.reshape(T, P, El), local.to(probs.dtype)], dim=-1)[token, dest]
    in_splits = layout.sent[me]
    out_splits = [layout.sent[s][me] for s in range(P)]
    recv_x = all_to_all_rows(send_x, out_splits, in_splits, handle.group)
    recv_aux = all_to_all_rows(aux, out_splits, in_splits, handle.group)
    return recv_x, recv_aux[:, El:] != 0, recv_aux[:, :El].contiguous()

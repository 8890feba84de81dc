"""MoELayer: router -> dispatcher -> experts -> combine, plus an optional shared expert.

Every stage keeps a token's result independent of the rest of the batch: the router's gating GEMM
and the experts are row-stable, the dispatchers return expert rows unreduced to the token's owner,
and the owner sums them in fixed (ascending expert) order in fp32. So for fixed weights a token's
output and gradients are bitwise identical on every EP rank, with either dispatcher and at any EP
size (dropless mode; capacity dropping depends on the batch by definition).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .agreement import hidden_states_problem
from .config import MoEConfig
from .dispatcher import build_dispatcher
from .dispatcher.functional import host_tokens_per_expert
from .experts import GroupedMLP, SequentialMLP
from .router import TopKRouter

# Offsets the shared expert's seed from the routed experts' seeds.
_SHARED_EXPERT_SEED_OFFSET = 104729


class MoELayer(nn.Module):
    """A mixture-of-experts layer with expert parallelism.

    Args:
        config: the MoEConfig shared by router, dispatcher and experts.
        ep_group: the expert-parallel process group. None means the default group when
            torch.distributed is initialised, else a single process holding every expert.

    Parameters are built from ``config.init_seed`` alone (router, shared expert) or from
    (init_seed, global expert id) (routed experts), so the same seed builds the same model at
    every EP size and on every rank.
    """

    def __init__(self, config: MoEConfig, ep_group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__()
        self.config = config
        # The dispatcher's one size exchange already rejects NaN/inf probabilities, on every rank
        # and with no extra synchronisation; the router's own check would add a host sync and
        # raise on one rank only, leaving the others waiting in the exchange.
        self.router = TopKRouter(config, check_finite=False)
        self.dispatcher = build_dispatcher(config, ep_group)
        if self.dispatcher.ep_size == 1 and not config.pad_to_capacity and config.pad_multiple == 1:
            # Our router routes a token to at most topk experts, so N = T * topk is known on the host:
            # the sync-free dispatch (no host read; dispatcher/static.py), bitwise the dropless one.
            self.dispatcher = build_dispatcher(self.dispatcher.config.replace(sync_free=True), ep_group)
        experts_cls = GroupedMLP if config.expert_impl == "grouped" else SequentialMLP
        num_local = self.dispatcher.num_local_experts
        self.experts = experts_cls(config, num_local, self.dispatcher.ep_rank * num_local)
        self.shared_expert: Optional[nn.Module] = None
        if config.shared_expert_ffn_hidden_size:
            shared_config = config.replace(num_experts=1, topk=1, pre_softmax=True, num_groups=None,
                                           group_topk=None, capacity_factor=None, pad_to_capacity=False,
                                           ffn_hidden_size=config.shared_expert_ffn_hidden_size,
                                           probs_in_experts=False,
                                           init_seed=config.init_seed + _SHARED_EXPERT_SEED_OFFSET)
            self.shared_expert = experts_cls(shared_config, 1, 0)

    @property
    def aux_losses(self) -> dict[str, torch.Tensor]:
        """Detached values of the losses the router attached in the last forward (for logging)."""
        return dict(self.router.last_losses)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [S, B, H] or [T, H] -> the same shape and dtype.

        Bad input (not a float tensor [T, H] / [S, B, H] with H = hidden_size on the layer's device
        type) raises the same ValueError on every EP rank: a rank that finds it locally routes no
        tokens and takes part in the dispatcher's size exchange with the error, so no rank waits.
        At the first forward the EP ranks agree on every MoEConfig field; one that differs is the
        same ValueError on every rank, naming the field and the ranks."""
        device = self.experts.weight1.device
        # Once per layer, before anything else runs: a configuration that differs across ranks
        # would abort gloo in the size exchange (num_experts), or silently make a token's result
        # depend on its rank (the router's and experts' settings).
        if not self.dispatcher.agreed:
            self.dispatcher.agree(device, self.config.field_values())
        problem = hidden_states_problem(hidden_states, self.config.hidden_size, device)
        agreed = self.dispatcher.static_agreed_input() if problem is not None else None
        if agreed is not None:
            # Sync-free at EP > 1 after its first step: the peers are in no size exchange, so this rank
            # takes part with zeros of the agreed shape and a bad input; every rank's outputs are NaN
            # and every rank raises at the next poll (dispatcher/static.py).
            hidden_states = torch.zeros(agreed[0], dtype=agreed[1], device=device)
        elif problem is not None:
            three_d = isinstance(hidden_states, torch.Tensor) and hidden_states.dim() == 3
            batch = tuple(hidden_states.shape[1:2]) if three_d else ()  # [S, B, H]: the same B
            self.router(torch.zeros((0, *batch, self.config.hidden_size), dtype=self.router.weight.dtype,
                                    device=device))
            self.dispatcher.raise_together(problem, device)
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        probs, routing_map = self.router(hidden_states)
        expert_input, handle = self.dispatcher.dispatch_rows(None if agreed else tokens, routing_map, probs)
        if handle.trailing_rows:  # sync-free: device counts, read only by a GEMM path that needs them
            expert_output = self.experts(expert_input, handle.expert_counts, handle.permuted_probs,
                                         offsets=handle.expert_offsets, trailing_rows=True)
        else:
            expert_output = self.experts(expert_input, host_tokens_per_expert(handle), handle.permuted_probs,
                                         offsets=handle.expert_offsets)
        output = self.dispatcher.combine(expert_output, handle)
        if agreed is not None or handle.input_replaced:
            # NaN in this rank's own shape; the graph stays, so the backward's collectives still run.
            nan = torch.full(hidden_states.shape, float("nan"), dtype=output.dtype, device=output.device)
            return nan + output.sum() * 0
        if self.shared_expert is not None:
            T = tokens.shape[0]
            # host counts for the loop GEMMs; device offsets (a fill, no copy) for grouped_mm
            counts = torch.tensor([T], dtype=torch.int64)
            offsets = torch.full((1,), T, dtype=torch.int32, device=tokens.device)
            output = output + self.shared_expert(tokens, counts, offsets=offsets).reshape(output.shape)
        return output.reshape(hidden_states.shape)

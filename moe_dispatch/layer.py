"""MoELayer: router -> dispatcher -> experts -> combine, plus an optional shared expert.

Every stage keeps a token's result independent of the rest of the batch: the router's gating GEMM
and the experts are row-stable, the dispatchers return expert rows unreduced to the token's owner,
and the owner sums them in fixed (ascending expert) order in fp32. So for fixed weights a token's
output and gradients are bitwise identical on every EP rank, with either dispatcher and at any EP
size (dropless mode; capacity dropping depends on the batch by definition).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from .config import FP8_FORMATS, MoEConfig
from .dispatcher import Fp8Rows, build_dispatcher, to_expert_rows
from .distributed.agreement import DeviceProblem, hidden_states_problem
from .distributed.comm import group_key, group_size_rank
from .experts import GroupedMLP, SequentialMLP, layer_seed
from .experts.fp8_weights import Fp8ExpertWeights, fp8_weights_bits_problem, fp8_weights_problem
from .experts.wrappers import check_ddp, check_fsdp
from .router import TopKRouter

# Offsets the shared expert's seed from the routed experts' seeds.
_SHARED_EXPERT_SEED_OFFSET = 104729


class MoELayer(nn.Module):
    """A mixture-of-experts layer with expert parallelism.

    Args:
        config: the MoEConfig shared by router, dispatcher and experts.
        ep_group: the expert-parallel process group. None means the default group when
            torch.distributed is initialised, else a single process holding every expert.
        layer_index: which MoE layer of the model this is (an int >= 0; required, so that
            layers of one model never start identical by accident). Give each layer its own.

    Parameters are built from ``layer_seed(config.init_seed, layer_index)`` alone (router, shared
    expert) or from (that seed, global expert id) (routed experts), so the same seed and index
    build the same layer at every EP size and on every rank; layer 0's seed is init_seed itself.
    The routed experts' state dict carries their global ids (DTensor shards at EP > 1, see
    `moe_dispatch.experts.mlp`); under data parallelism see `moe_dispatch.parallel`.
    """

    def __init__(self, config: MoEConfig, ep_group: Optional[dist.ProcessGroup] = None, *,
                 layer_index: int) -> None:
        super().__init__()
        if not isinstance(layer_index, int) or isinstance(layer_index, bool) or layer_index < 0:
            raise ValueError(f"layer_index must be an int >= 0, got {layer_index!r}")
        self.config = config
        self.layer_index = layer_index
        seeded = config.replace(init_seed=layer_seed(config.init_seed, layer_index))
        # The dispatcher's one size exchange already rejects NaN/inf probabilities, on every rank
        # and with no extra synchronisation; the router's own check would add a host sync and
        # raise on one rank only, leaving the others waiting in the exchange.
        self.router = TopKRouter(seeded, check_finite=False, ep_group=group_key(ep_group))
        dispatch_config = config.dispatch_config()
        if group_size_rank(ep_group)[0] == 1 and not config.pad_to_capacity and config.pad_multiple == 1:
            # Our router routes a token to at most topk experts, so N = T * topk is known on the host:
            # the sync-free dispatch (no host read; dispatcher/sync_free/), bitwise the dropless one.
            dispatch_config = dispatch_config.replace(sync_free=True)
        # built once: each dispatcher takes the next layer id of its group (identity)
        self.dispatcher = build_dispatcher(dispatch_config, ep_group)
        experts_cls = GroupedMLP if config.expert_impl == "grouped" else SequentialMLP
        num_local = self.dispatcher.num_local_experts
        sharded_over = group_key(ep_group) if self.dispatcher.ep_size > 1 else None
        self.experts = experts_cls(seeded, num_local, self.dispatcher.ep_rank * num_local, ep_group=sharded_over)
        self.shared_expert: Optional[nn.Module] = None
        if config.shared_expert_ffn_hidden_size:
            shared_config = config.replace(num_experts=1, topk=1, pre_softmax=True, num_groups=None,
                                           group_topk=None, capacity_factor=None, pad_to_capacity=False,
                                           ffn_hidden_size=config.shared_expert_ffn_hidden_size,
                                           probs_in_experts=False, fp8=None, fp8_wgrad=True,  # dense: the tokens' dtype
                                           init_seed=seeded.init_seed + _SHARED_EXPERT_SEED_OFFSET)
            self.shared_expert = experts_cls(shared_config, 1, 0)

    @property
    def aux_losses(self) -> dict[str, torch.Tensor]:
        """Detached values of the losses the router attached in the last forward (for logging)."""
        return dict(self.router.last_losses)

    def quantize_fp8_weights(self) -> Fp8ExpertWeights:
        """An FP8 layer's expert weights quantised once, for ``forward(x, fp8_weights=...)`` of every
        micro-batch until the next optimizer step (bitwise the per-call quantisation's results;
        `moe_dispatch.experts.fp8_weights` says when a handle is refused as stale)."""
        return self.experts.quantize_fp8_weights()

    def forward(self, hidden_states: torch.Tensor, *, fp8_weights: Optional[Fp8ExpertWeights] = None) -> torch.Tensor:
        """hidden_states [S, B, H] or [T, H] -> the same shape and dtype. ``fp8_weights`` (an FP8
        layer): this layer's ``quantize_fp8_weights()`` since the last optimizer step, or None to
        quantise the expert weights in this call.

        Bad input (not a float tensor [T, H] / [S, B, H] with H = hidden_size on the layer's device
        type) raises the same ValueError on every EP rank: a rank that finds it locally routes no
        tokens and takes part in the dispatcher's size exchange with the error, so no rank waits.
        At the first forward the EP ranks agree on every MoEConfig field; one that differs is the
        same ValueError on every rank, naming the field and the ranks (``layer_index`` included).
        Every rank must call its layers in the same order (each step's exchange names the layer, see
        ``moe_dispatch.distributed.identity``), and every rank calls backward on a loss that depends on the
        output, or none does: when any rank's hidden states or experts need gradients the output
        requires grad on every rank, so that a rank that needs none still runs the backward's
        exchanges the others wait in. Inside a DistributedDataParallel that owns the routed experts
        across ranks holding different experts, or with the routed experts sharded by FSDP2: a ValueError
        (`moe_dispatch.parallel.check_ddp`, `check_fsdp`)."""
        guarded = self._guard(hidden_states, fp8_weights)  # may raise on every rank, or replace a bad input
        hidden_states = guarded.hidden_states
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])  # [T, H]
        probs, routing_map = self.router(hidden_states)  # the router sees the unquantised tokens
        # The payload, decided once: the tokens, or in FP8 their rows quantised (their gradient to
        # the tokens). Every stage below runs alike on either. None: a bad input, taking part as zeros.
        payload = None if guarded.replaced else tokens
        if payload is not None and self.config.fp8 is not None:
            payload = Fp8Rows.quantize(tokens, FP8_FORMATS[self.config.fp8])
        expert_input, handle = self.dispatcher.dispatch_rows(payload, routing_map, probs,
                                                             experts_need_grad=self._experts_need_grad(),
                                                             device_problem=guarded.bits_problem)
        # per-source weight gradients only while the experts collect them (experts.collect_source_grads)
        rows = to_expert_rows(expert_input, handle, source_blocks=self.experts.source_grads is not None)
        expert_output = self.experts(rows, fp8_weights=guarded.fp8_weights, fp8_weights_checked=True)
        output = self.dispatcher.combine(expert_output, handle)
        if guarded.replaced or handle.input_replaced:
            # NaN in the shape taken part with; the graph stays, so the backward's collectives still run.
            nan = torch.full(hidden_states.shape, float("nan"), dtype=output.dtype, device=output.device)
            return nan + output.sum() * 0
        if self.shared_expert is not None:
            output = output + self._shared_expert_output(tokens).reshape(output.shape)
        return output.reshape(hidden_states.shape)

    def _guard(self, hidden_states: Any, fp8_weights: Optional[Fp8ExpertWeights]) -> _Guarded:
        """Every check before the step, in one place: data parallelism over the routed experts, the
        configuration agreed across the EP group (once), the input and the FP8 weights handle.

        A problem found here raises the same ValueError on every EP rank: this rank takes part in
        the step's size exchange with it (``raise_together``). Sync-free at EP > 1 after its first
        step there is no size exchange: this rank then takes part with zeros of the agreed shape
        (``replaced``), every rank's outputs are NaN and every rank raises at the next poll
        (dispatcher/sync_free/). The FP8 weights' bits are compared on the device (``bits_problem``),
        carried by the dispatch."""
        device = self.experts.weight1.device
        check_ddp(self.experts)
        check_fsdp(self.experts)
        # Once per layer, before anything else runs: a configuration that differs across ranks
        # would abort gloo in the size exchange (num_experts), or silently make a token's result
        # depend on its rank (the router's and experts' settings).
        if not self.dispatcher.agreed:
            self.dispatcher.agree(device, [*self.config.field_values(), ("layer_index", self.layer_index)])
        problem = hidden_states_problem(hidden_states, self.config.hidden_size, device)
        bits_problem = None
        if problem is None and fp8_weights is not None:
            problem = fp8_weights_problem(fp8_weights, self.experts)
            if problem is None:
                bits_problem = fp8_weights_bits_problem(fp8_weights, self.experts)
        if problem is None:
            return _Guarded(hidden_states, fp8_weights, bits_problem)
        agreed = self.dispatcher.sync_free_agreed_input()
        if agreed is not None:
            # the problem may be the FP8 weights handle: the step runs on without it
            return _Guarded(torch.zeros(agreed[0], dtype=agreed[1], device=device), None, None, replaced=True)
        three_d = isinstance(hidden_states, torch.Tensor) and hidden_states.dim() == 3
        batch = tuple(hidden_states.shape[1:2]) if three_d else ()  # [S, B, H]: the same B
        self.router(torch.zeros((0, *batch, self.config.hidden_size), dtype=self.router.weight.dtype, device=device))
        self.dispatcher.raise_together(problem, device)  # always raises
        raise AssertionError("raise_together returned")  # unreachable

    def _experts_need_grad(self) -> bool:
        """Whether this rank's experts train: agreed with the group in the size exchange, so that a
        rank whose inputs and experts need no gradient still runs the backward's exchanges."""
        return torch.is_grad_enabled() and any(p.requires_grad for p in self.experts.parameters())

    def _shared_expert_output(self, tokens: torch.Tensor) -> torch.Tensor:
        """The shared expert on every token: tokens [T, H] -> [T, H]."""
        T = tokens.shape[0]
        # host counts for the loop GEMMs; device offsets (a fill, no copy) for grouped_mm
        counts = torch.tensor([T], dtype=torch.int64)
        offsets = torch.full((1,), T, dtype=torch.int32, device=tokens.device)
        return self.shared_expert(tokens, counts, offsets=offsets)


@dataclass(frozen=True)
class _Guarded:
    """The forward's input after ``MoELayer._guard``: the hidden states to route (the caller's, or
    zeros of the agreed shape when ``replaced``: this rank's input was bad and its outputs are NaN),
    the FP8 weights handle to use (None: quantise per call), and the device comparison of its bits."""

    hidden_states: torch.Tensor
    fp8_weights: Optional[Fp8ExpertWeights]
    bits_problem: Optional[DeviceProblem]
    replaced: bool = False

"""Row-stable GEMMs inside Megatron's router and experts (``make_row_stable``): SequentialMLP (with
Megatron's or TransformerEngine's linears) and TEGroupedMLP. A row's result then does not depend
on the rows sharing the GEMM call, which cuBLAS (and CPU fp32 ``mm`` below 8 rows) does not
promise."""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Optional

from .config import moe_config_from_megatron
from .supported import check_row_stable_supported, megatron_field, megatron_fp8_wgrad, row_stable_activation

if TYPE_CHECKING:
    import torch


def make_row_stable(moe_layer: Any, quantize_weights_once: bool = False) -> Any:
    """Run a Megatron MoELayer's router gating and expert GEMMs row-stably.

    The experts: SequentialMLP (Megatron's or TransformerEngine's linears) or TEGroupedMLP (TE's
    GroupedLinear, ``weight0`` .. ``weight{El-1}`` per projection); ``supported.expert_layout``.
    The layer keeps its modules, parameters and state-dict names; two forwards are replaced:
    - ``router.gating``: logits = hidden @ weight.T in the router dtype through
      ``moe_dispatch.router.gating_linear`` (bitwise independent of the other rows). With
      ``moe_router_fusion`` the router gets its own copy of the config with the flag off: its
      top-k and scores run Megatron's unfused torch code, the same numbers with or without the
      flag (TE's fused router kernel is not used);
    - ``experts.forward``: ``moe_dispatch.experts.expert_gemm`` (grouped_mm where row-stable, else
      the ordered / tiled fallbacks) on the local experts' fc1 / fc2 weights and Megatron's
      activation (``activation_func``; TE's activation module and TE's grouped GEMM, its
      quantisation padding and its op fuser are not run). The probs: when the layer's
      dispatcher is ours with ``probs_in_experts=False`` (what ``install`` builds), the experts
      ignore ``permuted_probs`` and the combine weights each expert row by its prob inside its
      fixed-order fp32 sum (no separate multiply pass, forward or backward);
      otherwise they are multiplied into the activation in fp32 and rounded once, as
      Megatron's MLP does before fc2. With our dispatcher's FP8 wire (``install(fp8=...)``) the
      experts take its FP8 rows and run both GEMMs in FP8 (``_fp8_experts``), their weights
      quantised in each forward or, with ``quantize_weights_once``, kept from one forward to the
      next until they may have changed (``install``).
    The expert weights are first moved into one stacked storage per projection
    (``experts.stack_expert_weights``: same Parameter objects, names, shapes and state-dict keys;
    each weight a view of its slice), which the GEMMs read without a copy and whose gradients
    arrive as contiguous [out, in] slices. Call it before wrapping the model in Megatron's
    DistributedDataParallel: weights DDP has already moved into its buffer stay there (then every
    forward copies them, with a warning). Optimizers may be built before or after.
    Results agree with Megatron's own GEMMs within rounding (not bitwise: other kernels).
    Returns moe_layer. Raises ValueError (``check_row_stable_supported``) for unsupported layers.
    """
    import types

    import torch

    from ...experts import activate, scale_rows
    from ...router import gating_linear
    from .experts import expert_linear, expert_weights, restack_after_conversion, stack_expert_weights, warn_copied

    check_row_stable_supported(moe_layer)
    config, experts, router = moe_layer.config, moe_layer.experts, moe_layer.router
    activation = row_stable_activation(config)
    # Megatron's gating dtype: moe_router_dtype ('fp32'/'fp64'), else the input's (as our router's)
    router_config = moe_config_from_megatron(config, megatron_layer=True)

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = router_config.probs_dtype(input.dtype)
        logits = gating_linear(input.reshape(-1, input.shape[-1]), self.weight, dtype)
        return logits.reshape(input.shape[:-1] + (logits.shape[-1],))

    def experts_forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                        permuted_probs: torch.Tensor):
        x = permuted_local_hidden_states
        if not isinstance(tokens_per_expert, torch.Tensor):
            tokens_per_expert = torch.as_tensor(tokens_per_expert)
        offsets, trailing = _expert_offsets(self, tokens_per_expert)
        if _fp8_dispatcher(self) is not None:
            return _fp8_experts(self, x, offsets is not None, permuted_probs, activation), None
        h = expert_linear(x, expert_weights(self, "linear_fc1"), tokens_per_expert, offsets, self, trailing)
        act = activate(h, activation)
        if _experts_apply_probs(self):
            act = scale_rows(act, permuted_probs)
        return expert_linear(act, expert_weights(self, "linear_fc2"), tokens_per_expert, offsets, self,
                             trailing), None

    if not stack_expert_weights(experts):
        warn_copied(experts, stacklevel=3)
    restack_after_conversion(experts)
    router.gating = types.MethodType(gating, router)
    if megatron_field(router.config, "moe_router_fusion", False):
        unfused = copy.copy(router.config)  # this router's own: the layer's config keeps the flag
        unfused.moe_router_fusion = False
        router.config = unfused
    experts.forward = types.MethodType(experts_forward, experts)
    experts._moe_dispatch_dispatcher = moe_layer.token_dispatcher
    experts._moe_dispatch_quantize_weights_once = quantize_weights_once
    experts._moe_dispatch_fp8_weights = None  # (WeightStamp, fingerprints, operands): quantize_weights_once
    moe_layer._moe_dispatch_row_stable = True
    return moe_layer


def _fp8_dispatcher(experts: Any) -> Any:
    """The layer's dispatcher when it is ours with the FP8 wire (``install(fp8=...)``), else None."""
    from .dispatcher import MegatronTokenDispatcher

    dispatcher = getattr(experts, "_moe_dispatch_dispatcher", None)
    if isinstance(dispatcher, MegatronTokenDispatcher) and dispatcher.config.fp8 is not None:
        return dispatcher
    return None


def _fp8_experts(experts: Any, rows: "torch.Tensor", plan_counts: bool, permuted_probs: "torch.Tensor",
                 activation: str) -> "torch.Tensor":
    """The experts (SequentialMLP or TEGroupedMLP) on the dispatch's FP8 wire rows [N, W] -> [N, H] in the tokens'
    dtype, as our LocalExperts in FP8: fc1 on the rows' fp8 values and per-row scales (their
    gradient to the dispatch's ``Fp8Rows.grad_sink``), the activation in the tokens' dtype, fc2
    quantising it per row (``fp8_expert_gemm``), the weights read from their stacked storage. A
    sync-free plan's device counts and trailing rows as they come (nothing read on the host).
    ``plan_counts``: Megatron passed the plan's own counts (``_expert_offsets``), which the rows
    then split by (``to_expert_rows``)."""
    import dataclasses

    from ...config import FP8_FORMATS
    from ...dispatcher import to_expert_rows
    from ...experts import fp8_mlp
    from .experts import expert_weights, stacked_weights

    dispatcher = _fp8_dispatcher(experts)
    handle, config = dispatcher.handle, dispatcher.config
    fp8_rows = dispatcher.fp8_rows(rows)
    if handle is None or fp8_rows is None or not plan_counts:
        raise ValueError("install(fp8=...): the experts take this step's FP8 rows with the plan's counts "
                         "(dispatch_postprocess's tokens_per_expert), from the layer's dispatcher")
    # Megatron's own rows and probs, split by the plan's counts
    expert_rows = dataclasses.replace(to_expert_rows(fp8_rows, handle), probs=permuted_probs)
    # [El, out, in] stacks, transposed to fp8_expert_gemm's [E, K, M] (no copy)
    fc1, fc2 = expert_weights(experts, "linear_fc1"), expert_weights(experts, "linear_fc2")
    w1 = stacked_weights(fc1, experts).transpose(1, 2)
    w2 = stacked_weights(fc2, experts).transpose(1, 2)
    fp8_dtype = FP8_FORMATS[config.fp8]
    operands = None
    if experts._moe_dispatch_quantize_weights_once:
        operands = _weights_quantised_once(experts, [*fc1, *fc2], w1, w2, fp8_dtype)
    return fp8_mlp(expert_rows, w1, w2, activation, apply_probs=_experts_apply_probs(experts), fp8_dtype=fp8_dtype,
                   weight_operands=operands, fp8_wgrad=megatron_fp8_wgrad(experts.config))


def _weights_quantised_once(experts: Any, weights: list, w1: "torch.Tensor", w2: "torch.Tensor",
                            fp8_dtype: "torch.dtype") -> Optional[tuple]:
    """The FP8 operands of w1 and w2 (``quantize_weight``'s) kept on ``experts`` while ``weights``
    (the Parameters they stack) have not changed, else quantised again and kept; None inside a
    CUDA-graph capture (the forward then quantises per call, in the graph). Changed: what
    ``weights_problem`` sees on the host (an optimizer step, a change autograd counts, new
    storage), or bits that differ from the fingerprint taken when the operands were made (a write
    autograd does not count: ``dist.broadcast``, ``p.data.copy_``), compared on the device and read
    on the host here (on CUDA one synchronisation per forward that keeps them)."""
    import torch

    from ...experts import quantize_weight, stamp_weights, weights_problem
    from ...ops import bits_fingerprint

    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    # the stacked [El, out, in] weights the operands are made from (contiguous when stacked in place)
    sources = (w1.transpose(1, 2), w2.transpose(1, 2))
    kept = experts._moe_dispatch_fp8_weights
    if kept is not None and weights_problem(kept[0], weights) is None:
        stamp, bits, operands = kept
        with torch.no_grad():
            differ = torch.stack([(bits_fingerprint(s) != b).any() for s, b in zip(sources, bits)]).any()
        if not bool(differ):
            return operands
    stamp = stamp_weights(weights)  # before quantising: what the operands are made from
    with torch.no_grad():
        bits = tuple(bits_fingerprint(s) for s in sources)
        operands = (quantize_weight(w1, fp8_dtype), quantize_weight(w2, fp8_dtype))
    experts._moe_dispatch_fp8_weights = (stamp, bits, operands)
    return operands


def _experts_apply_probs(experts: Any) -> bool:
    """False only when the layer's dispatcher is ours and its combine applies the probs."""
    from .dispatcher import MegatronTokenDispatcher

    dispatcher = getattr(experts, "_moe_dispatch_dispatcher", None)
    return not isinstance(dispatcher, MegatronTokenDispatcher) or dispatcher.config.probs_in_experts


def _expert_offsets(experts: Any, tokens_per_expert: "torch.Tensor") -> tuple[Optional["torch.Tensor"], bool]:
    """(the dispatcher's device offsets, int32 [El], cumsum of the rows per expert; its
    ``trailing_rows``) when tokens_per_expert is this step's own (the plan's CPU counts, or a
    sync-free step's device counts), so grouped_mm copies and reads nothing on the host; else
    (None, False)."""
    from .dispatcher import MegatronTokenDispatcher

    dispatcher = getattr(experts, "_moe_dispatch_dispatcher", None)
    handle = dispatcher.handle if isinstance(dispatcher, MegatronTokenDispatcher) else None
    if handle is not None and (handle.rows_per_expert is tokens_per_expert
                               or (not handle.trailing_rows and handle.host_rows_per_expert is tokens_per_expert)):
        return handle.expert_offsets, handle.trailing_rows
    return None, False

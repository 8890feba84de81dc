"""Row-stable GEMMs inside Megatron's router and SequentialMLP experts (``make_row_stable``): a
row's result then does not depend on the rows sharing the GEMM call, which cuBLAS (and CPU fp32
``mm`` below 8 rows) does not promise."""
from __future__ import annotations

from typing import Any

from .config import moe_config_from_megatron
from .supported import check_row_stable_supported, row_stable_activation


def make_row_stable(moe_layer: Any) -> Any:
    """Run a Megatron MoELayer's router gating and SequentialMLP expert GEMMs row-stably.

    The layer keeps its modules, parameters and state-dict names; two forwards are replaced:
    - ``router.gating``: logits = hidden @ weight.T in the router dtype through
      ``moe_dispatch.router.gating_linear`` (bitwise independent of the other rows);
    - ``experts.forward``: the local experts' fc1 / fc2 weights stacked ([El, H, F1], [El, F, H])
      into ``moe_dispatch.experts.expert_gemm`` (grouped_mm where row-stable, else the padded /
      tiled fallbacks), Megatron's activation, and the probs multiplied into the activation in
      fp32 and rounded once, exactly as Megatron's MLP does before fc2.
    Results agree with Megatron's own GEMMs within rounding (not bitwise: other kernels).
    Returns moe_layer. Raises ValueError (``check_row_stable_supported``) for unsupported layers.
    """
    import types

    import torch

    from ...experts.activations import activate, scale_rows
    from ...experts.gemm import expert_gemm, select_gemm
    from ...router.gating import gating_linear

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
        tokens_per_expert = torch.as_tensor(tokens_per_expert)
        w1 = torch.stack([e.linear_fc1.weight.t() for e in self.local_experts]).to(x.dtype)  # [El, H, F1]
        w2 = torch.stack([e.linear_fc2.weight.t() for e in self.local_experts]).to(x.dtype)  # [El, F, H]
        h = expert_gemm(x, w1, tokens_per_expert, select_gemm(x, w1, True, True))
        act = scale_rows(activate(h, activation), permuted_probs)
        return expert_gemm(act, w2, tokens_per_expert, select_gemm(act, w2, True, True)), None

    router.gating = types.MethodType(gating, router)
    experts.forward = types.MethodType(experts_forward, experts)
    moe_layer._moe_dispatch_row_stable = True
    return moe_layer

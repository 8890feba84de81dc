"""Rank body of tests/integrations/test_megatron_te.py: install() on megatron-core's MoELayer whose
experts have TransformerEngine's parameter layouts, on one CPU gloo rank (EP 1; hidden 64, ffn 32,
8 experts, top-2: megatron_worker.py's shapes, weights and tokens).

TransformerEngine cannot be installed on a CPU machine, so the TE modules here are STAND-INS, not
TE: ``TEGroupedMLP`` has what install() reads of Megatron's TEGroupedMLP (class name,
``num_local_experts``, ``config``, ``linear_fc1`` / ``linear_fc2``) and each of those what it reads
of TE's GroupedLinear wrapper (``num_gemms``, ``weight0`` .. ``weight{n-1}`` each [out, in],
``use_bias``, ``single_grouped_weight``, an ``_extra_state`` entry); ``TEColumnParallelLinear`` /
``TERowParallelLinear`` hold one ``weight`` [out, in] (a SequentialMLP with TE linears). Their own
forwards compute what TE's would, unfused, so that Megatron's stock layer runs with them. The
parameter names, shapes and state-dict keys are those of megatron-core 0.16.1 to HEAD with TE 2.x
(read from megatron/core/extensions/transformer_engine.py and TE's grouped_linear.py).
"""
from __future__ import annotations

import copy
import logging
import warnings

import torch
import torch.distributed as dist

from .megatron_worker import KINDS, H, _build, _config, _pg, _setup, _tokens, outcome

FP8 = "e4m3"


class _GroupedLinearStandIn(torch.nn.Module):
    """Stand-in for TE's GroupedLinear as Megatron wraps it (TEColumnParallelGroupedLinear /
    TERowParallelGroupedLinear): ``weight{i}`` [out, in] per GEMM, no bias."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias, self.single_grouped_weight = False, False
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.empty(out_features, in_features,
                                                                                 dtype=dtype)))

    def get_extra_state(self) -> torch.Tensor:  # TE without FP8: an empty uint8 tensor
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        pass

    def forward(self, x: torch.Tensor, m_splits: list) -> tuple:
        outs = [xe @ getattr(self, f"weight{i}").t() for i, xe in enumerate(torch.split(x, m_splits))]
        return torch.cat(outs), None


class TEGroupedMLP(torch.nn.Module):
    """STAND-IN for megatron.core.transformer.moe.experts.TEGroupedMLP (see the module doc)."""

    def __init__(self, num_local_experts: int, config, dtype: torch.dtype) -> None:
        super().__init__()
        self.config, self.num_local_experts = config, num_local_experts
        ffn = config.moe_ffn_hidden_size
        fc1_out = 2 * ffn if config.gated_linear_unit else ffn
        self.linear_fc1 = _GroupedLinearStandIn(num_local_experts, config.hidden_size, fc1_out, dtype)
        self.linear_fc2 = _GroupedLinearStandIn(num_local_experts, ffn, config.hidden_size, dtype)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor) -> tuple:
        splits = torch.as_tensor(tokens_per_expert).tolist()
        h, _ = self.linear_fc1(x, splits)
        h = (self.config.activation_func(h) * permuted_probs.unsqueeze(-1)).to(h.dtype)
        return self.linear_fc2(h, splits)[0], None


class _LinearStandIn(torch.nn.Module):
    """Stand-in for Megatron's TE linear wrappers (TE's Linear): one ``weight`` [out, in]."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        pass

    def forward(self, x: torch.Tensor) -> tuple:
        return x @ self.weight.t(), None


class TEColumnParallelLinear(_LinearStandIn):
    """STAND-IN for Megatron's TEColumnParallelLinear (an expert's linear_fc1)."""


class TERowParallelLinear(_LinearStandIn):
    """STAND-IN for Megatron's TERowParallelLinear (an expert's linear_fc2)."""


def _with_te_grouped_experts(layer):
    """``layer`` with its SequentialMLP experts swapped for the TEGroupedMLP stand-in holding the
    same weights (copies); returns the layer."""
    config = layer.config
    experts = TEGroupedMLP(layer.num_local_experts, config, config.params_dtype)
    with torch.no_grad():
        for i, expert in enumerate(layer.experts.local_experts):
            getattr(experts.linear_fc1, f"weight{i}").copy_(expert.linear_fc1.weight)
            getattr(experts.linear_fc2, f"weight{i}").copy_(expert.linear_fc2.weight)
    layer.experts = experts
    return layer


def _with_te_linears(layer):
    """``layer``'s SequentialMLP with each expert's linears swapped for TE-linear stand-ins holding
    the same Parameters; returns the layer."""
    for expert in layer.experts.local_experts:
        expert.linear_fc1 = TEColumnParallelLinear(expert.linear_fc1.weight)
        expert.linear_fc2 = TERowParallelLinear(expert.linear_fc2.weight)
    return layer


def _layer(kind: str, dtype: torch.dtype, pg, experts: str = "te_grouped", **config_fields):
    """Megatron's stock MoELayer (megatron_worker's seeded weights), experts ``experts``
    ('sequential', 'te_grouped', 'te_linears'); ``config_fields`` set after the config's own checks
    (TE-only settings that a CPU TransformerConfig would refuse)."""
    cfg = _config(kind, dtype, 1)
    layer = _build(cfg, pg, ours_from_spec=False)
    swap = {"sequential": lambda v: v, "te_grouped": _with_te_grouped_experts, "te_linears": _with_te_linears}
    layer = swap[experts](layer)
    for name, value in config_fields.items():
        setattr(cfg, name, value)
    return layer


def _raises(fn) -> str:
    """The type and message of what ``fn()`` raises; '' when it returns."""
    try:
        fn()
        return ""
    except Exception as exc:  # noqa: BLE001  (the stock layer's failure, whatever its type)
        return f"{type(exc).__name__}: {exc}"


def _step(layer, x: torch.Tensor, dy: torch.Tensor) -> dict:
    """One forward + backward on x [T, H] (as [T / 2, 2, H]): output, input, router and expert
    weight gradients (``expert_weights``' order: fc1 of every expert, then fc2)."""
    from moe_dispatch.integrations.megatron.experts import expert_weights

    layer.zero_grad(set_to_none=True)
    xi = x.reshape(-1, 2, H).clone().requires_grad_()
    out, _ = layer(xi)
    out.backward(dy.reshape(out.shape))
    weights = expert_weights(layer.experts, "linear_fc1") + expert_weights(layer.experts, "linear_fc2")
    return dict(out=out.detach().reshape(-1, H).clone(), gx=xi.grad.reshape(-1, H).clone(),
                router=layer.router.weight.grad.clone(), experts=[w.grad.clone() for w in weights])


def _adam_state(opt) -> list:
    """Adam's per-parameter tensors, in the optimizer's parameter order."""
    state = opt.state_dict()["state"]
    return [(k, state[k]["exp_avg"].clone(), state[k]["exp_avg_sq"].clone(), state[k]["step"].clone())
            for k in sorted(state)]


def _te_grouped_record(kind: str, dtype: torch.dtype, pg, x, dy) -> dict:
    """install() on the TEGroupedMLP stand-in beside install() on SequentialMLP with the same
    weights; the state dict, Parameters and Adam state before and after install()."""
    from moe_dispatch.integrations.megatron import install
    from moe_dispatch.integrations.megatron.experts import expert_weights, stacked_view

    rec = {}
    te = _layer(kind, dtype, pg)
    # Stock Megatron + (stand-in) TE: a training step, so that Adam has state to carry over
    opt = torch.optim.Adam(te.parameters(), lr=1e-3)
    rec["stock"] = _step(te, x, dy)
    opt.step()
    keys, params = list(te.state_dict()), dict(te.named_parameters())
    values = {k: v.clone() for k, v in te.state_dict().items()}
    adam = _adam_state(opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        install(te)
        rec["ours"] = _step(te, x, dy)
    rec["copy_warnings"] = [str(w.message) for w in caught if "stacked storage" in str(w.message)]
    rec["same_keys"] = list(te.state_dict()) == keys
    rec["same_parameters"] = all(p is params[n] for n, p in te.named_parameters()) and \
        len(dict(te.named_parameters())) == len(params)
    rec["same_values"] = all(torch.equal(v, values[k]) for k, v in te.state_dict().items())
    rec["same_adam"] = all(a[0] == b[0] and all(torch.equal(u, v) for u, v in zip(a[1:], b[1:]))
                           for a, b in zip(_adam_state(opt), adam))
    rec["stacked"] = all(stacked_view(expert_weights(te.experts, p)) is not None for p in ("linear_fc1", "linear_fc2"))
    opt.step()  # Adam keeps updating the very Parameters, in their stacked storage
    rec["stacked_after_step"] = all(stacked_view(expert_weights(te.experts, p)) is not None
                                    for p in ("linear_fc1", "linear_fc2"))
    rec["moved"] = not torch.equal(te.experts.linear_fc1.weight0, values["experts.linear_fc1.weight0"])
    seq = _layer(kind, dtype, pg, experts="sequential")  # the weights te had when it was installed
    with torch.no_grad():
        seq.router.weight.copy_(values["router.weight"])
        for i, expert in enumerate(seq.experts.local_experts):
            expert.linear_fc1.weight.copy_(values[f"experts.linear_fc1.weight{i}"])
            expert.linear_fc2.weight.copy_(values[f"experts.linear_fc2.weight{i}"])
    rec["sequential"] = _step(install(seq), x, dy)
    rec["sequential_seeded"] = _step(install(_layer(kind, dtype, pg, experts="sequential")), x, dy)
    rec["te_linears"] = _step(install(_layer(kind, dtype, pg, experts="te_linears")), x, dy)
    # Checkpoint round trip: stock TE's state dict into ours and back, bitwise
    stock_sd = {k: v.clone() for k, v in _layer(kind, dtype, pg).state_dict().items()}
    ours = install(_layer(kind, dtype, pg))
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(1)  # other values first, so that the load is seen
    ours.load_state_dict(stock_sd)
    back = _layer(kind, dtype, pg)
    back.load_state_dict(ours.state_dict())
    rec["round_trip"] = all(torch.equal(v, stock_sd[k]) for k, v in ours.state_dict().items()) and \
        all(torch.equal(v, stock_sd[k]) for k, v in back.state_dict().items())
    rec["round_trip_stacked"] = all(stacked_view(expert_weights(ours.experts, p)) is not None
                                    for p in ("linear_fc1", "linear_fc2"))
    # moe_permute_fusion and moe_router_fusion: stock cannot run them here (TE's fused kernels), ours
    # replaces them and equals the unfused layer bitwise
    fused = dict(moe_permute_fusion=True, moe_router_fusion=True)
    rec["stock_fused"] = _raises(lambda: _step(_layer(kind, dtype, pg, **fused), x, dy))
    fused_layer = install(_layer(kind, dtype, pg, **fused))
    rec["fused"] = _step(fused_layer, x, dy)
    rec["unfused"] = _step(install(_layer(kind, dtype, pg)), x, dy)
    rec["fused_config_kept"] = fused_layer.config.moe_router_fusion and not fused_layer.router.config.moe_router_fusion
    return rec


def _fp8_record(pg, x, dy) -> dict:
    """A config with TE's FP8 recipe set (fp8='hybrid', the dense layers'): install() runs the MoE
    layer in the tokens' dtype or in our FP8, bitwise as without the recipe; the refusals."""
    from moe_dispatch.integrations.megatron import install

    rec = {}
    kind, dtype = "alltoall", torch.bfloat16
    rec["plain"] = _step(install(_layer(kind, dtype, pg)), x, dy)
    rec["te_fp8"] = _step(install(_layer(kind, dtype, pg, fp8="hybrid")), x, dy)
    rec["plain_ours_fp8"] = _step(install(_layer(kind, dtype, pg), fp8=FP8), x, dy)
    rec["te_fp8_ours_fp8"] = _step(install(_layer(kind, dtype, pg, fp8="hybrid"), fp8=FP8), x, dy)
    rec["errors"] = {
        "fp8_param": outcome(lambda: install(_layer(kind, dtype, pg, fp8="hybrid", fp8_param=True))),
        "delay_wgrad": outcome(lambda: install(_layer(kind, dtype, pg, delay_wgrad_compute=True))),
        "glu_interleave": outcome(lambda: install(_layer(kind, dtype, pg, gated_linear_unit=True,
                                                         moe_mlp_glu_interleave_size=32))),
    }
    single = _layer(kind, dtype, pg)
    single.experts.linear_fc2.single_grouped_weight = True  # TE's moe_single_grouped_weight layout
    rec["errors"]["single_grouped_weight"] = outcome(lambda: install(single))
    quantised = _layer(kind, dtype, pg)
    quantised.experts.linear_fc1.weight3 = torch.nn.Parameter(_Float8StandIn(quantised.experts.linear_fc1.weight3))
    rec["errors"]["fp8_weights"] = outcome(lambda: install(quantised))
    return rec


class _Float8StandIn(torch.Tensor):
    """Stand-in for TE's Float8Tensor (a torch.Tensor subclass holding FP8 weights)."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_subclass(cls, data.detach())


def te_worker(rank: int, world_size: int) -> dict:
    """Runs on one gloo rank; returns every record and the plug-in's log lines."""
    assert world_size == 1
    _setup()
    records: list = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("moe_dispatch.integrations.megatron")
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    pg = _pg(dist.group.WORLD, dist.group.WORLD)
    out = {}
    for dname, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        x, dy = _tokens(dtype, "full")
        x, dy = x[:64], dy[:64]
        for kind in KINDS:
            out[(dname, kind)] = _te_grouped_record(kind, dtype, pg, x, dy)
    x, dy = _tokens(torch.bfloat16, "full")
    out["fp8"] = _fp8_record(pg, x[:64], dy[:64])
    out["log"] = copy.copy(records)
    return out

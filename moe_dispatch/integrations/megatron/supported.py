"""What of megatron-core we support, in one place: the one accessor for Megatron's objects
(``megatron_field``) and every check, each a ValueError that names the Megatron field.

- ``check_supported``: Megatron's MoELayer with our dispatcher (``install``, DeterministicMoELayer);
- ``sync_free_obstacle``, ``check_graph_capture``: when install()'s dispatcher runs sync-free, and
  the CUDA graphs that may then capture it;
- ``check_layer_supported``: our whole MoELayer built from a TransformerConfig;
- ``check_groups``: the process groups our dispatcher runs on;
- ``check_row_stable_supported``, ``expert_layout``: the layers whose GEMMs ``make_row_stable`` can
  swap (SequentialMLP, Megatron's or TE's linears; TEGroupedMLP);
- ``check_fp8``: install()'s own FP8 (per-token scales; beside Megatron's TE FP8 on the dense layers);
- ``warn_if_untested``: a megatron-core release outside the tested range (a warning only).
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...config import DISPATCHER_KINDS, FP8_FORMATS

SUPPORTED_DISPATCHERS = DISPATCHER_KINDS
# The megatron-core releases the test suite runs against (oldest, newest).
TESTED_MEGATRON_CORE = ("0.16.1", "0.19.2")
# Captured modules that hold the whole MoE layer (an empty list: the whole transformer layer).
_WHOLE_LAYER_SCOPES = ("moe", "full_iteration")
# Captured modules that hold dispatch_preprocess alone: Megatron replays it apart from the other
# five dispatcher calls, which run eagerly around it (not supported: each call checks the last).
_PARTIAL_DISPATCH_SCOPES = ("moe_preprocess",)
# Fields whose non-default value changes our whole layer in a way we do not implement.
_LAYER_UNSUPPORTED = {
    "moe_input_jitter_eps": None,
    "moe_router_force_load_balancing": False,
    "moe_enable_routing_replay": False,
    "moe_shared_expert_gate": False,
    "moe_apply_probs_on_input": False,
    "moe_router_padding_for_quantization": False,
    "moe_latent_size": None,
    "add_bias_linear": False,
}
_WARNED: set = set()


def megatron_field(obj: Any, name: str, default: Any = None) -> Any:
    """A field of one of Megatron's objects (TransformerConfig, ProcessGroupCollection, a layer)
    in any supported release: a field this release lacks counts as ``default``."""
    return getattr(obj, name, default)


def megatron_fp8_wgrad(config: Any) -> bool:
    """``TransformerConfig.fp8_wgrad`` (default True; Megatron's ``--no-fp8-wgrad`` sets it False):
    whether our FP8 experts' weight gradients run in FP8 (``MoEConfig.fp8_wgrad``)."""
    return megatron_field(config, "fp8_wgrad", True) is not False


def warn_if_untested(version: Optional[str] = None) -> bool:
    """Warn (once per version) when megatron-core is outside TESTED_MEGATRON_CORE; returns True
    when it is outside. Only this warning reads the version: behaviour follows features."""
    from packaging.version import Version  # a dependency of megatron-core

    if version is None:
        from megatron.core import package_info

        version = package_info.__version__
    low, high = TESTED_MEGATRON_CORE
    # Release numbers only: wheels carry local tags (0.19.2+27280d6), which sort above 0.19.2.
    inside = Version(low).release <= Version(version).release <= Version(high).release
    if not inside and version not in _WARNED:
        _WARNED.add(version)
        warnings.warn(f"moe_dispatch's Megatron plug-in is tested with megatron-core {low} through {high}; "
                      f"megatron-core {version} is installed: check it with `moe-dispatch check --megatron`",
                      stacklevel=3)
    return not inside


def check_dispatcher_supported(config: Any) -> None:
    """An MoE layer (``num_moe_experts``) with one of our dispatcher kinds: what every use of a
    TransformerConfig needs."""
    if not megatron_field(config, "num_moe_experts"):
        raise ValueError("num_moe_experts is not set: this TransformerConfig has no MoE layer")
    kind = megatron_field(config, "moe_token_dispatcher_type", "allgather")
    if kind == "flex":
        raise ValueError("moe_token_dispatcher_type='flex' (DeepEP / HybridEP) is not supported by "
                         "moe_dispatch: expected 'allgather' or 'alltoall'")
    if kind not in SUPPORTED_DISPATCHERS:
        raise ValueError(f"moe_token_dispatcher_type={kind!r} is not supported: expected one of "
                         f"{SUPPORTED_DISPATCHERS}")


def check_supported(config: Any, *, row_stable_gemms: bool = True, ep_size: Optional[int] = None) -> None:
    """Raise ValueError, naming the field, for Megatron settings our dispatcher cannot honour
    inside Megatron's MoELayer.

    config: megatron.core TransformerConfig of the MoE layer (any supported release: fields a
    release lacks count as their default). ``row_stable_gemms`` and ``ep_size`` (default: the
    config's ``expert_model_parallel_size``) decide whether the dispatcher runs sync-free, which
    CUDA graphs of the whole MoE layer need (``check_graph_capture``; install() checks again on
    the layer's EP group)."""
    check_dispatcher_supported(config)
    etp = megatron_field(config, "expert_tensor_parallel_size")
    if etp is None:  # Megatron's default: the attention TP size
        etp = megatron_field(config, "tensor_model_parallel_size", 1)
    if etp != 1:
        raise ValueError(f"expert tensor parallelism is not supported: expert_tensor_parallel_size="
                         f"{etp}, expected 1 (it defaults to tensor_model_parallel_size; set it to 1)")
    if megatron_field(config, "moe_shared_expert_overlap", False):
        raise ValueError("moe_shared_expert_overlap=True is not supported: Megatron computes the shared "
                         "experts inside its own dispatcher; expected False")
    if megatron_field(config, "overlap_moe_expert_parallel_comm", False):
        raise ValueError("overlap_moe_expert_parallel_comm=True is not supported: its schedule splits "
                         "the dispatch's autograd graph; expected False")
    if megatron_field(config, "moe_router_padding_for_quantization", False):
        raise ValueError("moe_router_padding_for_quantization=True is not supported: it pads inside "
                         "Megatron's dispatcher; expected False")
    if megatron_field(config, "transformer_impl") == "inference_optimized":
        raise ValueError("transformer_impl='inference_optimized' is not supported: its MoELayer swaps "
                         "Megatron's inference dispatcher in at every forward; expected 'local' or "
                         "'transformer_engine'")
    if ep_size is None:
        ep_size = megatron_field(config, "expert_model_parallel_size", 1) or 1
    check_graph_capture(config, sync_free_obstacle(config, ep_size, row_stable_gemms))
    router_dtype = megatron_field(config, "moe_router_dtype")
    if router_dtype not in (None, "fp32", "fp64"):
        raise ValueError(f"moe_router_dtype={router_dtype!r} is not supported: expected None, 'fp32' or 'fp64'")


def sync_free_obstacle(config: Any, ep_size: int, row_stable_gemms: bool) -> Optional[str]:
    """Why install()'s dispatcher cannot run this layer sync-free (no host read per step, so the
    layer can be captured in a CUDA graph), naming the setting and what is expected; None when it
    runs sync-free: EP size 1, dropless, and our row-stable experts (``row_stable_gemms``), which
    take device offsets. Megatron's router routes every token to exactly topk experts unless
    capacity dropping is set, so the receiver rows N = T * topk are known on the host."""
    if ep_size != 1:
        return (f"the layer's EP group has size {ep_size}, expected 1 (install() has no static-capacity "
                "exchange for EP > 1: there the dropless dispatch reads its split sizes on the host)")
    if not row_stable_gemms:
        return ("row_stable_gemms=False: Megatron's own experts read tokens_per_expert on the host; "
                "expected row_stable_gemms=True")
    capacity = megatron_field(config, "moe_expert_capacity_factor")
    if capacity is not None and capacity >= 0:  # Megatron: a negative factor means dropless
        return (f"moe_expert_capacity_factor={capacity!r} (capacity dropping / padding), expected None "
                "(dropless)")
    return None


def _scope_names(scopes: Any) -> list:
    if scopes is None:
        return []
    if isinstance(scopes, str):
        scopes = [s for s in scopes.split(",") if s]
    elif not isinstance(scopes, (list, tuple)):
        scopes = [scopes]
    return [megatron_field(s, "name", s) for s in scopes]


def _graph_settings(config: Any) -> tuple[str, str, list]:
    """(cuda_graph_impl, the field naming the captured modules, their names)."""
    graphs = megatron_field(config, "cuda_graph_impl", "none") or "none"
    # 0.18+ name the captured modules cuda_graph_modules (cuda_graph_scope is migrated into it).
    field = "cuda_graph_modules" if hasattr(config, "cuda_graph_modules") else "cuda_graph_scope"
    return graphs, field, _scope_names(megatron_field(config, field))


def captures_whole_layer(config: Any) -> bool:
    """Whether the config's CUDA graphs capture the whole MoE layer: cuda_graph_impl
    'full_iteration', or captured modules empty (the whole transformer layer) or holding 'moe' /
    'full_iteration'."""
    graphs, _, scopes = _graph_settings(config)
    if graphs == "none":
        return False
    return graphs == "full_iteration" or not scopes or any(s in _WHOLE_LAYER_SCOPES for s in scopes)


def check_graph_capture(config: Any, obstacle: Optional[str]) -> None:
    """Raise ValueError, naming the field, when the config's CUDA graphs would capture our
    dispatcher in a way it cannot be replayed. ``obstacle``: ``sync_free_obstacle``'s answer.

    Captures of the whole MoE layer (``cuda_graph_impl='full_iteration'``, captured modules empty
    (the whole transformer layer) or holding 'moe' / 'full_iteration') need the sync-free
    dispatch (obstacle None) and bf16 parameters (the row-stable grouped expert GEMM; other dtypes
    read tokens_per_expert on the host). 'moe_preprocess' is refused always: Megatron replays
    dispatch_preprocess alone and runs the other five dispatcher calls eagerly. Captures without
    the MoE layer (attn, mlp, moe_router alone) are not ours to check."""
    graphs, field, scopes = _graph_settings(config)
    if graphs == "none":
        return
    if graphs == "full_iteration":  # 0.18+: one graph of the whole forward-backward
        setting = "cuda_graph_impl='full_iteration'"
    else:
        setting = f"cuda_graph_impl={graphs!r} with {field}={scopes or '[] (whole layer)'}"
    if any(s in _PARTIAL_DISPATCH_SCOPES for s in scopes):
        raise ValueError(f"{setting} would capture dispatch_preprocess without the rest of the dispatch (Megatron "
                         f"replays it alone): expected {field} without moe_preprocess (e.g. ['attn', 'moe_router'] "
                         "with cuda_graph_impl='transformer_engine'), or the whole MoE layer captured (['moe'] or [], "
                         "with the sync-free dispatch)")
    if not captures_whole_layer(config):
        return
    if obstacle is not None:
        raise ValueError(f"{setting} would capture the dispatch, which is capturable only sync-free (install() at "
                         f"EP 1, dropless, row_stable_gemms=True), not here: {obstacle}; or expected "
                         f"cuda_graph_impl='none' or captured modules without the MoE layer")
    dtype = megatron_field(config, "params_dtype")
    if dtype is not None and dtype != torch.bfloat16:
        raise ValueError(f"{setting} with params_dtype={dtype}: the row-stable expert GEMMs read tokens_per_expert "
                         "on the host except bf16's grouped GEMM (CUDA sm90+); expected params_dtype=torch.bfloat16")


def one_loss(config: Any, name: str, default: Any) -> Any:
    """A load-balancing field's one value: Megatron accepts lists to combine several aux losses;
    we support exactly one."""
    value = megatron_field(config, name, default)
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"{name}={value!r}: combining several load-balancing losses is not supported")
        return value[0]
    return value


def megatron_activation(config: Any) -> str:
    """Our activation of Megatron's MLP (``activation_func``, ``gated_linear_unit``)."""
    import torch.nn.functional as F

    func = megatron_field(config, "activation_func", F.gelu)
    gated = bool(megatron_field(config, "gated_linear_unit", False))
    if gated and func is F.silu:
        return "swiglu"
    if not gated and func is F.gelu:
        return "gelu"
    if not gated and func is F.relu:
        return "relu"
    raise ValueError(
        f"activation_func={getattr(func, '__name__', func)!r} with gated_linear_unit={gated} "
        "has no MoEConfig.activation (supported: gelu, relu, silu+GLU=swiglu)"
    )


def check_layer_supported(config: Any) -> None:
    """Raise ValueError, naming the field, for Megatron features our whole MoELayer (router and
    experts) does not implement."""
    for name, default in _LAYER_UNSUPPORTED.items():
        if megatron_field(config, name, default) not in (default, None):
            raise ValueError(f"{name}={megatron_field(config, name)!r} is not supported by moe_dispatch")
    if one_loss(config, "moe_router_load_balancing_type", "aux_loss") == "sinkhorn":
        raise ValueError("moe_router_load_balancing_type='sinkhorn' is not supported")
    losses = one_loss(config, "moe_aux_loss_coeff", 0.0) or megatron_field(config, "moe_z_loss_coeff")
    if megatron_field(config, "calculate_per_token_loss", False) and losses:
        # Megatron then multiplies the losses by the local token count; we keep the plain means.
        raise ValueError("calculate_per_token_loss=True with MoE losses is not supported")
    megatron_activation(config)


def _group_size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def check_groups(pg_collection: Any) -> Any:
    """The EP group of Megatron's ProcessGroupCollection (``.ep``; ``.expt_tp`` and ``.tp_ep`` are
    checked when present). Raises ValueError for no EP group, or expert tensor parallelism
    (``expt_tp`` size != 1, or ``tp_ep`` not the EP group): our dispatchers split experts across
    EP ranks only."""
    ep = megatron_field(pg_collection, "ep")
    if ep is None:
        raise ValueError("pg_collection.ep (the expert-parallel group) is required")
    expt_tp = _group_size(megatron_field(pg_collection, "expt_tp"))
    if expt_tp != 1:
        raise ValueError(f"expert tensor parallelism is not supported: pg_collection.expt_tp has size "
                         f"{expt_tp}, expected 1 (set expert_tensor_parallel_size=1)")
    tp_ep = megatron_field(pg_collection, "tp_ep")
    if tp_ep is not None and _group_size(tp_ep) != _group_size(ep):
        raise ValueError(f"pg_collection.tp_ep has size {_group_size(tp_ep)} but ep has size {_group_size(ep)}; "
                         "with expert tensor parallel size 1 they must be the same group")
    return ep


def row_stable_activation(config: Any) -> str:
    """Our activation for the row-stable experts' forward (``make_row_stable``)."""
    if megatron_field(config, "activation_func_clamp_value") is not None or \
            megatron_field(config, "glu_linear_offset", 0.0):
        raise ValueError("row_stable_gemms: activation_func_clamp_value / glu_linear_offset are not supported; "
                         "expected None / 0.0 (or pass row_stable_gemms=False)")
    try:
        return megatron_activation(config)
    except ValueError as exc:
        act, gated = config.activation_func, bool(config.gated_linear_unit)
        raise ValueError(f"row_stable_gemms: activation_func={getattr(act, '__name__', act)} with "
                         f"gated_linear_unit={gated} is not supported; expected gelu, relu or "
                         "silu+gated_linear_unit (swiglu), or pass row_stable_gemms=False") from exc


# Config fields that make row-stable experts impossible, with the reason and what is expected.
_ROW_STABLE_REFUSED = (
    ("fp8_param", "TransformerEngine keeps the weights themselves in FP8 (--fp8-param-gather), which our GEMMs do "
     "not read; expected False (TE's FP8 recipe on the dense layers, fp8 / --fp8-format, is fine)"),
    ("fp4_param", "TransformerEngine keeps the weights themselves in FP4, which our GEMMs do not read; expected "
     "False"),
    ("delay_wgrad_compute", "TE's experts would compute the weight gradients later, and their parameters skip "
     "Megatron's gradient hooks, so our experts' gradients would never reach main_grad; expected False"),
    ("overlap_dispatch_backward_with_experts_wgrad", "it delays the experts' weight gradients (as "
     "delay_wgrad_compute); expected False"),
)


def expert_layout(experts: Any) -> str:
    """Which of Megatron's expert modules ``experts`` is, as ``make_row_stable`` reads its weights:
    'SequentialMLP' (Megatron's own or TransformerEngine's linears; ``local_experts[i].linear_fcX.weight``)
    or 'TEGroupedMLP' (TE's GroupedLinear, ``linear_fcX.weight0`` .. ``weight{El-1}``, one Parameter
    per GEMM). Each weight must be a plain 2-D tensor [out, in] (not TE's FP8 parameters). Raises
    ValueError naming the module and what is expected otherwise."""
    names = [c.__name__ for c in type(experts).__mro__]
    name = names[0]
    hint = "(or pass row_stable_gemms=False)"
    if name == "SequentialMLP" and hasattr(experts, "local_experts"):
        for i, expert in enumerate(experts.local_experts):
            for projection in ("linear_fc1", "linear_fc2"):
                _check_plain_weight(megatron_field(megatron_field(expert, projection), "weight"),
                                    f"SequentialMLP local_experts.{i}.{projection}.weight", hint)
        return "SequentialMLP"
    if "TEGroupedMLP" in names and name != "InferenceGroupedMLP":
        count = megatron_field(experts, "num_local_experts")
        for projection in ("linear_fc1", "linear_fc2"):
            linear = megatron_field(experts, projection)
            gemms = megatron_field(linear, "num_gemms")
            if gemms is None or gemms != count:
                raise ValueError(f"row_stable_gemms: TEGroupedMLP {projection} has num_gemms={gemms}, expected "
                                 f"num_local_experts={count} (one GEMM per local expert) {hint}")
            if megatron_field(linear, "single_grouped_weight", False) or megatron_field(linear, "weight0") is None:
                raise ValueError(f"row_stable_gemms: TEGroupedMLP {projection} holds its experts in one grouped "
                                 "'weight' parameter (moe_single_grouped_weight=True), which our GEMMs do not read; "
                                 f"expected weight0..weight{gemms - 1} (moe_single_grouped_weight=False) {hint}")
            if megatron_field(linear, "use_bias", False):
                raise ValueError(f"row_stable_gemms: TEGroupedMLP {projection} has biases; expected "
                                 f"add_bias_linear=False {hint}")
            for i in range(gemms):
                _check_plain_weight(megatron_field(linear, f"weight{i}"), f"TEGroupedMLP {projection}.weight{i}",
                                    hint)
        return "TEGroupedMLP"
    if name == "GroupedMLP":
        raise ValueError("row_stable_gemms: Megatron's legacy GroupedMLP (--moe-use-legacy-grouped-gemm) is not "
                         "supported; expected SequentialMLP (no --moe-grouped-gemm) or TEGroupedMLP "
                         f"(--moe-grouped-gemm with --transformer-impl transformer_engine) {hint}")
    raise ValueError(f"row_stable_gemms needs SequentialMLP or TEGroupedMLP experts, got {name} "
                     f"(use get_moe_module_spec(use_te=False) or Megatron's TE spec) {hint}")


def _check_plain_weight(weight: Any, where: str, hint: str) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or type(weight.data) is not torch.Tensor:
        kind = type(weight.data).__name__ if isinstance(weight, torch.Tensor) else type(weight).__name__
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else None
        raise ValueError(f"row_stable_gemms: {where} is {kind} of shape {shape}, expected a plain 2-D tensor "
                         f"[out, in] (TE's FP8 parameters, --fp8-param-gather, are not read by our GEMMs) {hint}")


def check_row_stable_supported(moe_layer: Any) -> None:
    """Raise ValueError, naming the field, if ``make_row_stable`` cannot swap this layer's GEMMs.

    TransformerEngine layers are supported: TEGroupedMLP and SequentialMLP with TE linears
    (``expert_layout``), and a config with TE's FP8 or FP4 recipe (``fp8`` / ``fp4``, which stays on
    the dense layers while the MoE layer runs in the model's dtype or our FP8). Refused: what
    cannot work (``_ROW_STABLE_REFUSED``: FP8/FP4 parameters, delayed weight gradients), biases,
    probs on the input, GLU weights interleaved for TE's fused op, activations we do not implement."""
    config = moe_layer.config
    expert_layout(megatron_field(moe_layer, "experts"))
    for field, why in _ROW_STABLE_REFUSED:
        if megatron_field(config, field, False):
            raise ValueError(f"row_stable_gemms: {field}={megatron_field(config, field)!r} is not supported: {why} "
                             "(or pass row_stable_gemms=False)")
    for field in ("add_bias_linear", "moe_apply_probs_on_input"):
        if megatron_field(config, field):
            raise ValueError(f"row_stable_gemms: {field}={megatron_field(config, field)!r} is not supported; "
                             "expected False/None (or pass row_stable_gemms=False)")
    interleave = megatron_field(config, "moe_mlp_glu_interleave_size")
    if interleave is not None and megatron_field(config, "gated_linear_unit", False):
        raise ValueError(f"row_stable_gemms: moe_mlp_glu_interleave_size={interleave!r} interleaves the GLU halves of "
                         "fc1's rows, and our swiglu takes the gate from the first half; expected None")
    row_stable_activation(config)
    router = megatron_field(moe_layer, "router")
    if router is None or megatron_field(router, "bias") is not None:
        raise ValueError("row_stable_gemms: the router must have a weight and no bias (add_bias_linear=False)")


def check_fp8(config: Any, fp8: Any, row_stable_gemms: bool) -> None:
    """Raise ValueError, naming the argument or field, when ``install(fp8=...)`` cannot run: a value
    outside ``FP8_FORMATS`` (MoEConfig's own error), Megatron's experts (``row_stable_gemms=False``:
    they cannot take FP8 rows), or hidden or expert ffn sizes not multiples of 16 (16-byte FP8 GEMM
    rows). None: nothing to check. Megatron's own FP8 (``config.fp8``, TransformerEngine's recipe)
    may be set too: it stays on the dense layers, the MoE layer runs ours. The sync-free dispatch is
    ``sync_free_obstacle``'s to allow or refuse, as without FP8 (the FP8 experts read no count on
    the host)."""
    if fp8 is None:
        return
    if not isinstance(fp8, str) or fp8 not in FP8_FORMATS:
        raise ValueError(f"fp8={fp8!r} is not one of {tuple(FP8_FORMATS)}")  # MoEConfig's message
    if not row_stable_gemms:
        raise ValueError(f"install(fp8={fp8!r}) needs row_stable_gemms=True: Megatron's own experts cannot take "
                         "the dispatch's FP8 rows")
    ffn_field = "moe_ffn_hidden_size" if megatron_field(config, "moe_ffn_hidden_size") else "ffn_hidden_size"
    for name in ("hidden_size", ffn_field):
        size = megatron_field(config, name)
        if size is None or size % 16:
            raise ValueError(f"install(fp8={fp8!r}) needs {name} a multiple of 16 (FP8 GEMM rows of 16 bytes), "
                             f"got {size}")


def check_quantize_weights_once(fp8: Any, quantize_weights_once: Any) -> None:
    """Raise ValueError, naming the argument, unless ``quantize_weights_once`` is a bool, and True only
    with ``fp8`` set (it keeps the FP8 experts' quantised weights between forwards)."""
    if not isinstance(quantize_weights_once, bool):
        raise ValueError(f"quantize_weights_once must be True or False, got {quantize_weights_once!r}")
    if quantize_weights_once and fp8 is None:
        raise ValueError("install(quantize_weights_once=True) needs fp8 (e.g. fp8='e4m3'): only the FP8 experts "
                         "quantise their weights")

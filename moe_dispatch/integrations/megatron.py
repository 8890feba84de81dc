"""Our dispatchers inside megatron-core's ``MoELayer``: megatron-core 0.16.1 through 0.19.2, written
against HEAD's (0.20) interface where it differs. Differences between releases are detected from
the installed package (attributes, signatures, spec types), never from its version string; a
version outside the tested range only adds a warning naming the range.

Upstream has no hook for the dispatcher: ``MoELayer.__init__`` builds its own from
``config.moe_token_dispatcher_type``. This module swaps it afterwards::

    from moe_dispatch.integrations.megatron import install
    layer = install(MoELayer(config, submodules, pg_collection=pg_collection))

or builds models with it::

    from moe_dispatch.integrations.megatron import DeterministicMoELayer, get_moe_module_spec
    spec = get_moe_module_spec(use_te=False, num_experts=64)      # Megatron's, MoELayer swapped
    layer_spec = deterministic_moe_spec(get_gpt_layer_local_spec(num_experts=64))  # any spec tree

With it installed, a token's MoE output and its gradients do not depend on the EP rank, the EP size,
the dispatcher (allgather / alltoall) or the other tokens of the batch. The dispatcher guarantees
that every local expert receives its rows in the fixed order (source rank, token), and that each
token's K expert outputs (and each token's gradient rows) are summed once, on the token's own rank,
in ascending expert order in fp32 (fp64 with an fp64 router). The rest needs Megatron's own GEMMs
to be row-stable (a row's result independent of the rows sharing the call): its router's gating
GEMM and ``SequentialMLP``'s one ``mm`` per expert are not (CPU fp32 ``mm`` below 8 rows; cuBLAS
on H200 at many row counts, BENCHMARKS.md). So ``install`` by default (``row_stable_gemms=True``)
also replaces those two forwards with our row-stable GEMMs on the same parameters
(``make_row_stable``); ``row_stable_gemms=False`` keeps Megatron's, matching its stock numerics.

Probabilities: Megatron's experts multiply ``permuted_probs`` into the activations before fc2, so
the dispatcher runs in ``probs_in_experts`` mode: it hands the experts fp32 (fp64 with
``moe_router_dtype='fp64'``) per-row probs and its combine sums unweighted; the probs are applied
exactly once. Probs from a bf16 router (``moe_router_dtype=None``) are upcast (exactly) to fp32
before they are sent: they never travel in 16 bits.

Supported (tested on CPU / gloo at EP 1 and 2 under megatron-core 0.16.1, 0.17.0, 0.18.0 and 0.19.2:
both dispatchers, fp32 and bf16 params, routers in fp32, fp64 and bf16, capacity padding; see
tests/integrations):
- ``moe_token_dispatcher_type`` 'allgather' and 'alltoall' (ours of the same kind is installed);
- the process groups of the layer's ``pg_collection`` (or Megatron's global parallel state):
  ``ep`` is the EP group; ``expt_tp`` must have size 1, so ``tp_ep`` is the EP group;
- ``moe_router_dtype`` None / 'fp32' / 'fp64', and every router option (top-k, groups, score
  functions, expert bias, aux / z losses, capacity dropping): the router is Megatron's;
- ``moe_expert_capacity_factor`` with or without ``moe_pad_expert_input_to_capacity`` (each
  expert then gets exactly its capacity from every source rank, Megatron's capacity formula);
- ``moe_permute_fusion`` is accepted and has no effect: the permutations are ours.
Outside the dispatcher, so not affected by it (but not tested here): attention TP / CP / DP / PP
around the layer (the dispatcher only uses the EP group), experts other than ``SequentialMLP``
(any that multiply ``permuted_probs`` in, as ``GroupedMLP`` and ``TEGroupedMLP`` do), shared experts
(not overlapped), ``moe_latent_size``, ``moe_apply_probs_on_input``, ``add_bias_linear``, FP8,
and MoE recomputation (the recomputed forward repeats the dispatch's collectives on every rank).

Not supported (``install`` / ``DeterministicMoELayer`` raise ``ValueError`` naming the field):
- ``moe_token_dispatcher_type='flex'`` (DeepEP / HybridEP kernels have their own reduction order);
- expert tensor parallelism: ``expert_tensor_parallel_size`` must be 1 (it defaults to
  ``tensor_model_parallel_size``); our dispatchers split experts across EP ranks only;
- ``moe_shared_expert_overlap=True``: Megatron runs the shared experts inside its own dispatcher;
- ``overlap_moe_expert_parallel_comm=True``: its schedule splits the dispatch's autograd graph;
- ``moe_router_padding_for_quantization=True``: Megatron's dispatcher pads the routing map for
  FP8/FP4; ours does not;
- CUDA graphs that capture the dispatch (``cuda_graph_impl`` 'full_iteration', or another impl with
  ``cuda_graph_modules`` (``cuda_graph_scope`` before 0.18) empty or containing moe /
  moe_preprocess / full_iteration): the dispatch reads the split sizes on the host once per step.
  Capturing only ``moe_router`` (or attn / mlp) is fine;
- ``transformer_impl='inference_optimized'`` (0.17+): its MoELayer swaps Megatron's inference
  dispatcher in at every forward.
Megatron's inference helper that toggles ``drop_and_pad`` on live dispatchers does not reach ours.

A bad ``hidden_states`` on one EP rank (shape, dtype, device, not a tensor) raises the same
ValueError on every EP rank, with every collective before the dispatcher still matched
(``check_inputs_together``, which ``install`` applies to the layer's forward).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import warnings
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Optional

from ..dispatcher import AllGatherDispatcher, AllToAllDispatcher, dispatcher_from_megatron, hidden_states_problem

if TYPE_CHECKING:
    import torch

__all__ = ["DeterministicMoELayer",  # noqa: F822  (built lazily, see __getattr__)
           "TESTED_MEGATRON_CORE", "check_inputs_together", "check_row_stable_supported", "check_supported",
           "megatron_moe_settings",
           "deterministic_moe_spec", "get_moe_module_spec", "install", "is_installed", "make_row_stable",
           "warn_if_untested"]

SUPPORTED_DISPATCHERS = ("allgather", "alltoall")
# The megatron-core releases the test suite runs against (oldest, newest).
TESTED_MEGATRON_CORE = ("0.16.1", "0.19.2")
# Parts of the MoE layer whose CUDA-graph capture would include the dispatch.
_GRAPHED_DISPATCH_SCOPES = ("moe", "moe_preprocess", "full_iteration")
_MOE_LAYER_PATH = ("megatron.core.transformer.moe.moe_layer", "MoELayer")
_WARNED: set = set()


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


def _scope_names(scopes: Any) -> list:
    if scopes is None:
        return []
    if isinstance(scopes, str):
        scopes = [s for s in scopes.split(",") if s]
    elif not isinstance(scopes, (list, tuple)):
        scopes = [scopes]
    return [getattr(s, "name", s) for s in scopes]


def _graph_capture_error(config: Any) -> Optional[str]:
    """Why this config's CUDA graphs would capture the dispatch, or None."""
    graphs = getattr(config, "cuda_graph_impl", "none") or "none"
    if graphs == "none":
        return None
    if graphs == "full_iteration":  # 0.18+: one graph of the whole forward-backward
        return "cuda_graph_impl='full_iteration' would capture the dispatch"
    # 0.18+ name the captured modules cuda_graph_modules (cuda_graph_scope is migrated into it).
    field = "cuda_graph_modules" if hasattr(config, "cuda_graph_modules") else "cuda_graph_scope"
    scopes = _scope_names(getattr(config, field))
    if scopes and not any(s in _GRAPHED_DISPATCH_SCOPES for s in scopes):
        return None
    return f"cuda_graph_impl={graphs!r} with {field}={scopes or '[] (whole layer)'} would capture the dispatch"


def check_supported(config: Any) -> None:
    """Raise ValueError, naming the field, for Megatron settings our dispatcher cannot honour.

    config: megatron.core TransformerConfig of the MoE layer (any supported release: fields a
    release lacks count as their default)."""
    get = lambda name, default=None: getattr(config, name, default)  # noqa: E731  (Megatron's config)
    if not get("num_moe_experts"):
        raise ValueError("num_moe_experts is not set: this TransformerConfig has no MoE layer")
    kind = get("moe_token_dispatcher_type", "allgather")
    if kind == "flex":
        raise ValueError("moe_token_dispatcher_type='flex' (DeepEP / HybridEP) is not supported by "
                         "moe_dispatch: expected 'allgather' or 'alltoall'")
    if kind not in SUPPORTED_DISPATCHERS:
        raise ValueError(f"moe_token_dispatcher_type={kind!r} is not supported: expected one of "
                         f"{SUPPORTED_DISPATCHERS}")
    etp = get("expert_tensor_parallel_size")
    if etp is None:  # Megatron's default: the attention TP size
        etp = get("tensor_model_parallel_size", 1)
    if etp != 1:
        raise ValueError(f"expert tensor parallelism is not supported: expert_tensor_parallel_size="
                         f"{etp}, expected 1 (it defaults to tensor_model_parallel_size; set it to 1)")
    if get("moe_shared_expert_overlap", False):
        raise ValueError("moe_shared_expert_overlap=True is not supported: Megatron computes the shared "
                         "experts inside its own dispatcher; expected False")
    if get("overlap_moe_expert_parallel_comm", False):
        raise ValueError("overlap_moe_expert_parallel_comm=True is not supported: its schedule splits "
                         "the dispatch's autograd graph; expected False")
    if get("moe_router_padding_for_quantization", False):
        raise ValueError("moe_router_padding_for_quantization=True is not supported: it pads inside "
                         "Megatron's dispatcher; expected False")
    if get("transformer_impl") == "inference_optimized":
        raise ValueError("transformer_impl='inference_optimized' is not supported: its MoELayer swaps "
                         "Megatron's inference dispatcher in at every forward; expected 'local' or "
                         "'transformer_engine'")
    why = _graph_capture_error(config)
    if why:
        raise ValueError(f"{why}, which reads split sizes on the host: expected cuda_graph_impl='none' or "
                         "captured modules without moe / moe_preprocess / full_iteration")
    router_dtype = get("moe_router_dtype")
    if router_dtype not in (None, "fp32", "fp64"):
        raise ValueError(f"moe_router_dtype={router_dtype!r} is not supported: expected None, 'fp32' or 'fp64'")


def _groups_of(moe_layer: Any, pg_collection: Any) -> Any:
    """(ep, expt_tp, tp_ep) groups: from pg_collection, else from the layer's current dispatcher."""
    if pg_collection is not None:
        return SimpleNamespace(ep=getattr(pg_collection, "ep", None), expt_tp=getattr(pg_collection, "expt_tp", None),
                               tp_ep=getattr(pg_collection, "tp_ep", None))
    current = getattr(moe_layer, "token_dispatcher", None)
    if is_installed(moe_layer):
        return SimpleNamespace(ep=current.ep_group, expt_tp=None, tp_ep=None)
    if current is not None and hasattr(current, "ep_group"):  # Megatron's MoETokenDispatcher
        return SimpleNamespace(ep=current.ep_group, expt_tp=getattr(current, "tp_group", None),
                               tp_ep=getattr(current, "tp_ep_group", None))
    ep = getattr(moe_layer, "ep_group", None)
    if ep is None:
        raise ValueError("install: the layer has no ep_group or token_dispatcher; pass pg_collection")
    return SimpleNamespace(ep=ep, expt_tp=None, tp_ep=None)


def megatron_moe_settings(config: Any) -> list[tuple[str, Any]]:
    """(name, value) of a TransformerConfig's MoE settings (``num_moe_experts`` and every
    ``moe_*`` field), which the EP ranks agree on before the router's first collective: a router
    setting that differs across ranks (the load-balancing type, a coefficient) would mismatch
    Megatron's aux-loss collectives or make a token's result depend on its rank."""
    names = ([f.name for f in dataclasses.fields(config)] if dataclasses.is_dataclass(config)
             else sorted(vars(config)))
    return [(n, getattr(config, n)) for n in names if n == "num_moe_experts" or n.startswith("moe_")]


def is_installed(moe_layer: Any) -> bool:
    """True when moe_layer.token_dispatcher is one of ours (``install``, or ``dispatcher_from_megatron``)."""
    return isinstance(getattr(moe_layer, "token_dispatcher", None), (AllGatherDispatcher, AllToAllDispatcher))


def install(moe_layer: Any, pg_collection: Optional[Any] = None, *, row_stable_gemms: bool = True) -> Any:
    """Replace ``moe_layer.token_dispatcher`` by ours of the same kind; returns ``moe_layer``.

    Args:
        moe_layer: a megatron.core ``MoELayer`` (built with any ``moe_token_dispatcher_type``
            except 'flex').
        pg_collection: the layer's ProcessGroupCollection (``.ep``, ``.expt_tp``, ``.tp_ep``);
            default: the groups of the layer's current dispatcher.
        row_stable_gemms: also run the router's gating GEMM and the SequentialMLP experts' GEMMs
            through our row-stable GEMMs (``make_row_stable``), same parameters. Needed for the
            contract on GPUs, where cuBLAS is not row-stable. False keeps Megatron's own GEMMs
            (then results equal Megatron's stock numerics, and the contract holds only where
            those GEMMs are row-stable, e.g. CPU bf16). The experts' weights then become views of
            one stacked storage per projection (same Parameter objects and state dict, see
            ``make_row_stable``): call install before wrapping the model in Megatron's
            DistributedDataParallel (it warns when DDP already moved them: each forward then
            copies them). Optimizers may be built before or after.

    Raises:
        ValueError: a setting we cannot honour (see the module docstring), or an EP group whose
            split of the experts differs from the layer's.

    The dispatcher is ``dispatcher_from_megatron(moe_layer.config, groups)``: probs applied once,
    by Megatron's experts. Idempotent: installing twice keeps one of ours (rebuilt from the same
    groups). Call it before the first forward; the dispatcher keeps one step's state between
    dispatch and combine.
    """
    config = moe_layer.config
    check_supported(config)
    warn_if_untested()
    if row_stable_gemms:
        check_row_stable_supported(moe_layer)
    dispatcher = dispatcher_from_megatron(config, _groups_of(moe_layer, pg_collection))
    expected = list(getattr(moe_layer, "local_expert_indices", dispatcher.local_expert_indices))
    if list(dispatcher.local_expert_indices) != expected:
        raise ValueError(f"EP group mismatch: the dispatcher's local experts {dispatcher.local_expert_indices} "
                         f"differ from the layer's local_expert_indices {expected}")
    moe_layer.token_dispatcher = dispatcher
    if row_stable_gemms:
        make_row_stable(moe_layer)
    check_inputs_together(moe_layer)
    return moe_layer


# --------------------------------------------------------------------------------------------
# A bad input on one rank: the same ValueError on every EP rank, every collective still matched
# --------------------------------------------------------------------------------------------
# Router buffers that a forward updates in place (expert-bias token counts; global aux loss
# accumulators; 0.19's quantile-balancing accumulators): put back when the forward raises, so a
# failed step leaves no trace in the next expert-bias or qb_beta update.
_ROUTER_STEP_BUFFERS = ("local_tokens_per_expert", "global_tokens_per_expert", "ga_steps", "qb_beta_accum",
                        "qb_beta_count")


def check_inputs_together(moe_layer: Any) -> Any:
    """Make a bad ``hidden_states`` on one EP rank raise the same ValueError on every EP rank of an
    install()'d Megatron MoELayer (wraps its ``forward``; ``install`` calls it). Returns moe_layer.

    Megatron's forward runs collectives before our dispatcher's size exchange, on groups that may
    contain other EP ranks (EP is folded over attention TP x CP x DP): the shared experts' TP
    all-gather / reduce-scatter / all-reduce ([S*B, H] sized), the router's aux-loss token counts
    (an all-reduce over tp_cp of [E] for aux_loss and of [B*E] for seq_aux_loss, over tp_dp_cp of
    [E] for global_aux_loss) and 0.19's quantile balancing (an all-gather of the [S*B, E] logits
    over tp_cp). The expert-bias and qb_beta updates and the aux-loss logging reductions run
    outside the forward. So a rank whose input fails ``hidden_states_problem`` (not a float tensor
    of 2 or 3 dims with the hidden size on the layer's device type) does not stop: it runs
    Megatron's forward on zeros of its input's leading shape [S, B] (for a non-tensor input, or one
    whose dims differ from the last good input's: that input's [S, B]; with neither, [1, 1]), so
    every one of those collectives gets the tensors it gets on its peers, and its dispatcher then
    takes part in the size exchange with the problem instead of the data: every EP rank raises the
    same ValueError, naming hidden_states, the expected value and the rank. On the good path this
    adds no collective and no host synchronisation: one host-side check of the input's shape and
    dtype, and a device copy of the router's in-place buffers (at most five [E] tensors, only those
    the config has), which every rank puts back when the forward raises.

    NaN or inf in hidden_states is a float input like any other for Megatron: it reaches the
    router, whose probs turn NaN, and the dispatcher's exchange rejects those on every rank
    (naming probs and the rank). On the first forward the dispatcher also agrees on its
    configuration and on Megatron's MoE settings (``megatron_moe_settings``) with the group,
    before the router's first collective.
    Idempotent."""
    import types

    if getattr(moe_layer, "_moe_dispatch_checks_inputs", False):
        return moe_layer

    def forward(self, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        megatron_forward = type(self).forward.__get__(self)  # looked up per call: a deepcopy wraps its own
        intermediate = kwargs.get("intermediate_tensors", args[0] if args else None)
        # CUDA-graph partial replay (not the layer's entry), or a dispatcher swapped back by hand
        if intermediate is not None or not is_installed(self):
            return megatron_forward(hidden_states, *args, **kwargs)
        dispatcher = self.token_dispatcher
        device = self.router.weight.device
        if not dispatcher.agreed:
            dispatcher.agree(device, megatron_moe_settings(self.config))
        problem = hidden_states_problem(hidden_states, dispatcher.config.hidden_size, device)
        saved = _router_step_state(self.router)
        try:
            if problem is None:
                self._moe_dispatch_leading_shape = tuple(hidden_states.shape[:-1])
                return megatron_forward(hidden_states, *args, **kwargs)
            padding_mask = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)
            _forward_standing_in(self, megatron_forward, problem, hidden_states, padding_mask, device)
        except BaseException:
            _restore_router_step_state(self.router, saved)
            raise

    moe_layer.forward = types.MethodType(forward, moe_layer)
    moe_layer._moe_dispatch_checks_inputs = True
    return moe_layer


def _router_step_state(router: Any) -> dict:
    import torch

    if not torch.is_grad_enabled():  # Megatron updates these only with grad enabled
        return {}
    buffers = ((name, getattr(router, name, None)) for name in _ROUTER_STEP_BUFFERS)
    return {name: b.detach().clone() for name, b in buffers if isinstance(b, torch.Tensor)}


def _restore_router_step_state(router: Any, saved: dict) -> None:
    import torch

    with torch.no_grad():
        for name, value in saved.items():
            getattr(router, name).copy_(value)


def _forward_standing_in(layer: Any, megatron_forward: Any, problem: Any, hidden_states: Any, padding_mask: Any,
                         device: "torch.device") -> None:
    """This rank's bad input: Megatron's forward on zeros of the same leading shape (so its
    collectives before the dispatcher match its peers'), its dispatch_preprocess replaced for this
    call by the size exchange with the problem. Always raises."""
    import torch

    # The input's own [S, B] (or [T]) where it has as many dims as this layer's last good input,
    # else that input's: a seq_aux_loss all-reduce is [B * E], a [T, H] stand-in would send [E].
    last = getattr(layer, "_moe_dispatch_leading_shape", None)
    own = tuple(hidden_states.shape[:-1]) if isinstance(hidden_states, torch.Tensor) and \
        hidden_states.dim() in (2, 3) else None
    leading = own if own is not None and (last is None or len(own) == len(last)) else (last or (1, 1))
    dtype = layer.config.params_dtype
    stand_in = torch.zeros((*leading, layer.config.hidden_size), dtype=dtype, device=device)
    # padding_mask [B, S]: kept where it fits the stand-in (it changes no collective's size)
    if not (isinstance(padding_mask, torch.Tensor) and len(leading) == 2 and
            tuple(padding_mask.shape) == tuple(reversed(leading))):
        padding_mask = None
    dispatcher = layer.token_dispatcher

    def raise_in_exchange(*_: Any) -> None:
        dispatcher.raise_together(problem, device)

    dispatcher.dispatch_preprocess = raise_in_exchange  # this call only (an instance attribute)
    try:  # in the caller's grad mode: the aux losses (and their all-reduces) run only with grad enabled
        megatron_forward(stand_in, intermediate_tensors=None, padding_mask=padding_mask)
    finally:
        del dispatcher.dispatch_preprocess
    # Megatron's forward did not reach the dispatcher (it cannot, in the supported settings).
    dispatcher.raise_together(problem, device)


# --------------------------------------------------------------------------------------------
# Row-stable GEMMs inside Megatron's router and SequentialMLP experts
# --------------------------------------------------------------------------------------------
def _activation_name(config: Any) -> str:
    """Our activation of the same function as Megatron's MLP (``activation_func``, glu)."""
    from ..config import _megatron_activation

    if getattr(config, "activation_func_clamp_value", None) is not None or getattr(config, "glu_linear_offset", 0.0):
        raise ValueError("row_stable_gemms: activation_func_clamp_value / glu_linear_offset are not supported; "
                         "expected None / 0.0 (or pass row_stable_gemms=False)")
    try:
        return _megatron_activation(config)
    except ValueError as exc:
        act, gated = config.activation_func, bool(config.gated_linear_unit)
        raise ValueError(f"row_stable_gemms: activation_func={getattr(act, '__name__', act)} with gated_linear_unit="
                         f"{gated} is not supported; expected gelu, relu or silu+gated_linear_unit (swiglu), "
                         "or pass row_stable_gemms=False") from exc


def check_row_stable_supported(moe_layer: Any) -> None:
    """Raise ValueError, naming the field, if ``make_row_stable`` cannot swap this layer's GEMMs."""
    config = moe_layer.config
    experts = getattr(moe_layer, "experts", None)
    if type(experts).__name__ != "SequentialMLP" or not hasattr(experts, "local_experts"):
        raise ValueError(f"row_stable_gemms needs SequentialMLP experts, got {type(experts).__name__} "
                         "(use get_moe_module_spec(use_te=False), or pass row_stable_gemms=False)")
    for field in ("add_bias_linear", "moe_apply_probs_on_input", "fp8", "fp4"):
        if getattr(config, field, None):
            raise ValueError(f"row_stable_gemms: {field}={getattr(config, field)!r} is not supported; expected "
                             "False/None (or pass row_stable_gemms=False)")
    _activation_name(config)
    router = getattr(moe_layer, "router", None)
    if router is None or getattr(router, "bias", None) is not None:
        raise ValueError("row_stable_gemms: the router must have a weight and no bias (add_bias_linear=False)")


def _router_dtype(config: Any, input_dtype: "torch.dtype") -> "torch.dtype":
    """The dtype of Megatron's gating GEMM: ``moe_router_dtype`` ('fp32'/'fp64'), else the input's."""
    from ..config import _ROUTER_DTYPES

    return _ROUTER_DTYPES.get(getattr(config, "moe_router_dtype", None), input_dtype)


def make_row_stable(moe_layer: Any) -> Any:
    """Run a Megatron MoELayer's router gating and SequentialMLP expert GEMMs row-stably.

    The layer keeps its modules, parameters and state-dict names; two forwards are replaced:
    - ``router.gating``: logits = hidden @ weight.T in the router dtype through
      ``moe_dispatch.router.gating_linear`` (bitwise independent of the other rows);
    - ``experts.forward``: ``moe_dispatch.experts.expert_gemm`` (grouped_mm where row-stable, else
      the padded / tiled fallbacks) on the local experts' fc1 / fc2 weights, Megatron's
      activation, and the probs multiplied into the activation in fp32 and rounded once, exactly
      as Megatron's MLP does before fc2.
    The expert weights are first moved into one stacked storage per projection
    (``megatron_experts.stack_expert_weights``: same Parameter objects, names, shapes and
    state-dict keys; each weight a view of its slice), which the GEMMs read without a copy and
    whose gradients arrive as contiguous [out, in] slices. Call it before wrapping the model in
    Megatron's DistributedDataParallel: weights DDP has already moved into its buffer stay there
    (then every forward copies them, with a warning). Optimizers may be built before or after.
    Results agree with Megatron's own GEMMs within rounding (not bitwise: other kernels).
    Returns moe_layer. Raises ValueError (``check_row_stable_supported``) for unsupported layers.
    """
    import types

    import torch

    from ..experts.activations import activate, scale_rows
    from ..router.gating import gating_linear
    from .megatron_experts import (
        expert_linear,
        expert_weights,
        restack_after_conversion,
        stack_expert_weights,
        warn_copied,
    )

    check_row_stable_supported(moe_layer)
    config, experts, router = moe_layer.config, moe_layer.experts, moe_layer.router
    activation = _activation_name(config)

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = _router_dtype(self.config, input.dtype)
        logits = gating_linear(input.reshape(-1, input.shape[-1]), self.weight, dtype)
        return logits.reshape(input.shape[:-1] + (logits.shape[-1],))

    def experts_forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                        permuted_probs: torch.Tensor):
        x = permuted_local_hidden_states
        if not isinstance(tokens_per_expert, torch.Tensor):
            tokens_per_expert = torch.as_tensor(tokens_per_expert)
        offsets = _expert_offsets(self, tokens_per_expert)
        h = expert_linear(x, expert_weights(self, "linear_fc1"), tokens_per_expert, offsets, self)
        act = scale_rows(activate(h, activation), permuted_probs)
        return expert_linear(act, expert_weights(self, "linear_fc2"), tokens_per_expert, offsets, self), None

    if not stack_expert_weights(experts):
        warn_copied(experts, stacklevel=3)
    restack_after_conversion(experts)
    router.gating = types.MethodType(gating, router)
    experts.forward = types.MethodType(experts_forward, experts)
    experts._moe_dispatch_dispatcher = moe_layer.token_dispatcher
    moe_layer._moe_dispatch_row_stable = True
    return moe_layer


def _expert_offsets(experts: Any, tokens_per_expert: "torch.Tensor") -> Optional["torch.Tensor"]:
    """The dispatcher's device offsets (int32 [El], cumsum of the rows per expert) when
    tokens_per_expert is this step's own, so grouped_mm copies nothing host-to-device; else None."""
    dispatcher = getattr(experts, "_moe_dispatch_dispatcher", None)
    handle = dispatcher.handle if isinstance(dispatcher, (AllGatherDispatcher, AllToAllDispatcher)) else None
    if handle is not None and handle.tokens_per_expert is tokens_per_expert:
        return handle.expert_offsets
    return None


def _megatron_moe_layer() -> type:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return MoELayer


_CLASSES: dict = {}


def _deterministic_moe_layer_class() -> type:
    """Build DeterministicMoELayer on first use, so that importing this module (install,
    check_supported) does not import megatron-core."""
    if "DeterministicMoELayer" not in _CLASSES:
        base = _megatron_moe_layer()
        # Keyword arguments that this release's MoELayer takes (is_mtp_layer: 0.17+, name: 0.18+).
        accepted = set(inspect.signature(base.__init__).parameters)

        class DeterministicMoELayer(base):
            """megatron.core MoELayer with our dispatcher of the same kind installed.

            Same constructor as MoELayer (HEAD's: ``is_mtp_layer`` and ``name`` are passed on where
            the installed release takes them), plus ``row_stable_gemms`` (default True; see
            ``install``, set it through ``get_moe_module_spec`` / ``deterministic_moe_spec``);
            raises ValueError up front (before Megatron builds its own dispatcher) for the settings
            listed in this module's docstring.

            megatron-core 0.16 and 0.17 build a ModuleSpec MLP with ``pg_collection`` (and 0.17
            ``is_mtp_layer``) only when its module is MoELayer itself, and log "Unknown MLP type"
            otherwise: this class then gets Megatron's default process groups (the global parallel
            state, as MoELayer without pg_collection), and raises if their EP size differs from
            ``expert_model_parallel_size``. From 0.18 the spec is a partial that gets every argument."""

            def __init__(self, config: Any, submodules: Any = None, layer_number: Optional[int] = None,
                         pg_collection: Optional[Any] = None, is_mtp_layer: bool = False,
                         name: Optional[str] = None, row_stable_gemms: bool = True) -> None:
                check_supported(config)
                extra = {}
                for key, value, default in (("is_mtp_layer", is_mtp_layer, False), ("name", name, None)):
                    if key in accepted:
                        extra[key] = value
                    elif value != default:
                        raise TypeError(f"DeterministicMoELayer: {key}={value!r} needs a megatron-core whose "
                                        f"MoELayer takes {key} (this one does not)")
                super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                                 pg_collection=pg_collection, **extra)
                install(self, pg_collection, row_stable_gemms=row_stable_gemms)
                ep = getattr(config, "expert_model_parallel_size", None)
                if pg_collection is None and ep is not None and ep != self.token_dispatcher.ep_size:
                    # megatron-core <= 0.17's TransformerLayer passes pg_collection only to a spec
                    # whose module is MoELayer itself: without it Megatron's default groups are used.
                    raise ValueError(f"DeterministicMoELayer got no pg_collection, and Megatron's default EP group "
                                     f"has size {self.token_dispatcher.ep_size}, not expert_model_parallel_size={ep}: "
                                     "pass pg_collection, or initialise Megatron's parallel state to match")

        DeterministicMoELayer.__module__ = __name__
        DeterministicMoELayer.__qualname__ = "DeterministicMoELayer"
        _CLASSES["DeterministicMoELayer"] = DeterministicMoELayer
    return _CLASSES["DeterministicMoELayer"]


def __getattr__(name: str) -> Any:  # PEP 562: DeterministicMoELayer is built lazily
    if name == "DeterministicMoELayer":
        return _deterministic_moe_layer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_moe_layer(module: Any, moe_layer: type) -> bool:
    return module is moe_layer or (isinstance(module, tuple) and tuple(module) == _MOE_LAYER_PATH)


def deterministic_moe_spec(spec: Any, row_stable_gemms: bool = True) -> Any:
    """A copy of a Megatron spec tree where every MoELayer is DeterministicMoELayer, built with
    ``row_stable_gemms`` (see ``install``).

    ``spec``: a layer spec, a block spec, a list of them, a TransformerBlockSubmodules, or an MoE
    spec itself. Both kinds of MoE spec are handled: a ``ModuleSpec(module=MoELayer, ...)``
    (megatron-core <= 0.17) and a ``functools.partial(MoELayer, submodules=...)`` (0.18+); each
    keeps its kind."""
    moe_layer = _megatron_moe_layer()
    deterministic = _deterministic_moe_layer_class()
    seen: dict = {}

    def visit(node: Any) -> Any:
        """node, with its MoELayer specs replaced (in place where mutable; partials are rebuilt)."""
        if node is None or isinstance(node, (str, bytes, int, float, bool, type)):
            return node
        if id(node) in seen:
            return seen[id(node)]
        seen[id(node)] = node
        if isinstance(node, functools.partial):
            args = tuple(visit(a) for a in node.args)
            keywords = {k: visit(v) for k, v in node.keywords.items()}
            if _is_moe_layer(node.func, moe_layer):
                replaced = functools.partial(deterministic, *args, **keywords, row_stable_gemms=row_stable_gemms)
            else:
                replaced = functools.partial(node.func, *args, **keywords)
            seen[id(node)] = replaced
            return replaced
        if isinstance(node, list):
            node[:] = [visit(item) for item in node]
            return node
        if isinstance(node, tuple):
            replaced = type(node)(*(visit(item) for item in node)) if hasattr(node, "_fields") else \
                tuple(visit(item) for item in node)
            seen[id(node)] = replaced
            return replaced
        if isinstance(node, dict):
            for key in list(node):
                node[key] = visit(node[key])
            return node
        module = getattr(node, "module", None)
        if _is_moe_layer(module, moe_layer):
            node.module = deterministic
            node.params = dict(getattr(node, "params", None) or {}, row_stable_gemms=row_stable_gemms)
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            for f in dataclasses.fields(node):
                value = getattr(node, f.name)
                new = visit(value)
                if new is not value:
                    object.__setattr__(node, f.name, new)  # a deep copy: frozen dataclasses too
        return node

    return visit(copy.deepcopy(spec))


def get_moe_module_spec(*args: Any, row_stable_gemms: bool = True, **kwargs: Any) -> Any:
    """megatron.core.models.gpt.moe_module_specs.get_moe_module_spec (same arguments, same kind of
    spec: a ModuleSpec up to 0.17, a functools.partial from 0.18), with the module
    DeterministicMoELayer built with ``row_stable_gemms`` (see ``install``)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec as megatron_spec

    return deterministic_moe_spec(megatron_spec(*args, **kwargs), row_stable_gemms)

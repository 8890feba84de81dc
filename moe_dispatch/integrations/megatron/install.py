"""``install``: our dispatcher of the same kind in place of a megatron-core MoELayer's own, with
(by default) the layer's router and expert GEMMs made row-stable and bad inputs raised together.

Upstream has no hook for the dispatcher: ``MoELayer.__init__`` builds its own from
``config.moe_token_dispatcher_type``, so ``install`` swaps it afterwards."""
from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any, Optional

import torch.distributed as dist

from .dispatcher import dispatcher_from_megatron, is_installed
from .inputs import check_inputs_together
from .row_stable import make_row_stable
from .supported import (
    captures_whole_layer,
    check_fp8,
    check_graph_capture,
    check_groups,
    check_quantize_weights_once,
    check_row_stable_supported,
    check_supported,
    expert_layout,
    megatron_field,
    sync_free_obstacle,
    warn_if_untested,
)

logger = logging.getLogger(__name__.rpartition(".")[0])  # moe_dispatch.integrations.megatron
_LOGGED: set = set()


def _log_once(message: str) -> None:
    """Log ``message`` (INFO) the first time this process sees it: a model's layers share one line."""
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.info(message)


def install_messages(moe_layer: Any, row_stable_gemms: bool, fp8: Optional[str]) -> list[str]:
    """What ``install`` logs (once per process each): the route the layer now takes, and the
    Megatron settings it accepts by replacing what they would run (fused permute and router,
    TransformerEngine's FP8 recipe, which stays on the dense layers)."""
    config = moe_layer.config
    kind = megatron_field(config, "moe_token_dispatcher_type", "allgather")
    wire = f"our per-token FP8 ({fp8})" if fp8 else "the tokens' dtype"
    if row_stable_gemms:
        experts = expert_layout(megatron_field(moe_layer, "experts"))
        route = (f"our {kind} dispatcher, row-stable router gating and {experts} expert GEMMs on Megatron's own "
                 f"parameters, dispatch and experts in {wire}")
    else:
        route = f"our {kind} dispatcher, Megatron's own router and experts"
    messages = [f"moe_dispatch: install() on Megatron's MoELayer: {route}"]
    te_fp8 = megatron_field(config, "fp8")
    if te_fp8:
        recipe = megatron_field(config, "fp8_recipe")
        recipe = getattr(recipe, "value", recipe)
        messages.append(f"moe_dispatch: fp8={te_fp8!r} (TransformerEngine, recipe {recipe!r}) stays on the dense "
                        f"layers; the MoE layers run {wire}")
    fused = []
    if megatron_field(config, "moe_permute_fusion", False):
        fused.append("moe_permute_fusion=True (our dispatcher replaces Megatron's fused permute / unpermute)")
    if megatron_field(config, "moe_router_fusion", False):
        fused.append("moe_router_fusion=True (the router's top-k and scores run Megatron's unfused code beside our "
                     "row-stable gating; TE's fused router kernel is not used)" if row_stable_gemms else
                     "moe_router_fusion=True (Megatron's fused router kept: row_stable_gemms=False)")
    if fused:
        messages.append("moe_dispatch: accepted " + "; ".join(fused))
    return messages


def _groups_of(moe_layer: Any, pg_collection: Any) -> Any:
    """The layer's (ep, expt_tp, tp_ep) groups: pg_collection, else its current dispatcher's."""
    if pg_collection is not None:
        return pg_collection
    current = megatron_field(moe_layer, "token_dispatcher")
    if is_installed(moe_layer):
        return SimpleNamespace(ep=current.ep_group)
    if current is not None and hasattr(current, "ep_group"):  # Megatron's MoETokenDispatcher
        return SimpleNamespace(ep=current.ep_group, expt_tp=megatron_field(current, "tp_group"),
                               tp_ep=megatron_field(current, "tp_ep_group"))
    ep = megatron_field(moe_layer, "ep_group")
    if ep is None:
        raise ValueError("install: the layer has no ep_group or token_dispatcher; pass pg_collection")
    return SimpleNamespace(ep=ep)


def install(moe_layer: Any, pg_collection: Optional[Any] = None, *, row_stable_gemms: bool = True,
            sync_free: Optional[bool] = None, fp8: Optional[str] = None,
            quantize_weights_once: bool = False) -> Any:
    """Replace ``moe_layer.token_dispatcher`` by ours of the same kind; returns ``moe_layer``.

    Args:
        moe_layer: a megatron.core ``MoELayer`` (built with any ``moe_token_dispatcher_type``
            except 'flex').
        pg_collection: the layer's ProcessGroupCollection (``.ep``, ``.expt_tp``, ``.tp_ep``);
            default: the groups of the layer's current dispatcher.
        row_stable_gemms: also run the router's gating GEMM and the experts' GEMMs (SequentialMLP
            with Megatron's or TransformerEngine's linears, or TEGroupedMLP) through our row-stable
            GEMMs (``make_row_stable``), same parameters. Needed for the
            contract on GPUs, where cuBLAS is not row-stable. False keeps Megatron's own GEMMs
            (then results equal Megatron's stock numerics, and the contract holds only where
            those GEMMs are row-stable, e.g. CPU bf16). The experts' weights then become views of
            one stacked storage per projection (same Parameter objects and state dict, see
            ``make_row_stable``): call install before wrapping the model in Megatron's
            DistributedDataParallel (it warns when DDP already moved them: each forward then
            copies them). Optimizers may be built before or after.

    Raises:
        ValueError: a setting we cannot honour (``check_supported``), or an EP group whose
            split of the experts differs from the layer's.

    The dispatcher is ``dispatcher_from_megatron(moe_layer.config, groups, probs_in_experts=...)``:
    with ``row_stable_gemms`` the combine applies the probs in its fp32 sum (our experts' forward
    ignores ``permuted_probs``), else Megatron's experts multiply them (once either way).
    ``sync_free``: run the sync-free dispatch (no host read in the forward or backward of the
    dispatch and our experts; bitwise the dropless dispatch's results), which CUDA graphs of the
    whole MoE layer need (``check_graph_capture``). It needs EP size 1, no capacity dropping and
    ``row_stable_gemms`` (``sync_free_obstacle``). None (default): sync-free exactly when the
    config captures the whole MoE layer in CUDA graphs (``captures_whole_layer``), else the
    dropless dispatch, which reads its split sizes on the host once per step; True: sync-free or
    a ValueError saying why not; False: dropless.
    ``fp8``: None (default), or 'e4m3' (a key of ``moe_dispatch.config.FP8_FORMATS``, the values of
    ``MoEConfig.fp8``): our per-token FP8, as ``MoELayer(MoEConfig(fp8=...))`` runs it. Each token's
    row is quantised once before the dispatch with its own fp32 scale, FP8 rows and scales travel,
    and the row-stable experts run both GEMMs in FP8 (``moe_dispatch.experts.fp8_expert_gemm``:
    fc1 on the dispatched rows and scales, fc2 quantising its input per row); the combine stays
    the fp32 weighted sum. Needs ``row_stable_gemms`` and hidden and expert ffn sizes multiples of
    16 (``check_fp8``). The TransformerConfig's own ``fp8`` (TransformerEngine's recipe) may be set
    too: it stays on the dense layers. It runs sync-free (and so captures) where the layer would without FP8.
    Shared experts and the rest of the model
    keep Megatron's dtype.
    ``quantize_weights_once`` (needs ``fp8``; default False: quantised in each forward): the
    experts keep their weights' FP8 operands (``moe_dispatch.experts.quantize_weight``'s, for the
    forward and the dgrad) from one forward to the next, and quantise again only after an optimizer
    step (torch's global step hook: Megatron's optimizers, which step torch optimizers and then copy
    into the model's weights, are covered), a change of a weight that autograd counts
    (``load_state_dict``, ``copy_``) or new storage for one: what TransformerEngine does across
    micro-batches with ``is_first_microbatch``, which Megatron signals only under its own FP8. Results
    are bitwise those of per-forward quantisation. It costs memory: the operands take as many bytes as
    the bf16 weights. A write autograd does not count (``dist.broadcast``, ``p.data.copy_``) is
    seen by a fingerprint of the weights' bits compared at each such forward and read on the host
    (on CUDA one synchronisation per forward), then quantised again.
    Inside a CUDA-graph capture the experts quantise per forward (the graph re-reads the weights at
    each replay) and keep nothing.
    ``moe_permute_fusion`` and ``moe_router_fusion`` are accepted: our dispatcher replaces the
    fused permute, and with ``row_stable_gemms`` the router runs Megatron's unfused top-k
    (``make_row_stable``). install logs (INFO, logger ``moe_dispatch.integrations.megatron``) the
    route it set up and what it accepted, each line once per process (``install_messages``).
    Idempotent: installing twice keeps one of ours (rebuilt from the same groups). Call it
    before the first forward; the dispatcher keeps one step's state between dispatch and combine.
    """
    config = moe_layer.config
    check_supported(config, row_stable_gemms=row_stable_gemms)
    check_fp8(config, fp8, row_stable_gemms)
    check_quantize_weights_once(fp8, quantize_weights_once)
    warn_if_untested()
    if row_stable_gemms:
        check_row_stable_supported(moe_layer)
    groups = _groups_of(moe_layer, pg_collection)
    ep = check_groups(groups)
    obstacle = sync_free_obstacle(config, 1 if ep is None else dist.get_world_size(ep), row_stable_gemms)
    if sync_free is False:
        obstacle = obstacle or "install(sync_free=False)"
    elif sync_free and obstacle is not None:
        raise ValueError(f"install(sync_free=True): the layer cannot run sync-free: {obstacle}")
    check_graph_capture(config, obstacle)  # again, on the layer's own EP group
    run_sync_free = obstacle is None and (bool(sync_free) or captures_whole_layer(config))
    dispatcher = dispatcher_from_megatron(config, groups, probs_in_experts=not row_stable_gemms,
                                          sync_free=run_sync_free, fp8=fp8)
    expected = list(megatron_field(moe_layer, "local_expert_indices", dispatcher.local_expert_indices))
    if dispatcher.local_expert_indices != expected:
        raise ValueError(f"EP group mismatch: the dispatcher's local experts {dispatcher.local_expert_indices} "
                         f"differ from the layer's local_expert_indices {expected}")
    moe_layer.token_dispatcher = dispatcher
    messages = install_messages(moe_layer, row_stable_gemms, fp8)  # before the router's config is copied
    if row_stable_gemms:
        make_row_stable(moe_layer, quantize_weights_once=quantize_weights_once)
    check_inputs_together(moe_layer)
    for message in messages:
        _log_once(message)
    return moe_layer


"""``install``: our dispatcher of the same kind in place of a megatron-core MoELayer's own, with
(by default) the layer's router and expert GEMMs made row-stable and bad inputs raised together.

Upstream has no hook for the dispatcher: ``MoELayer.__init__`` builds its own from
``config.moe_token_dispatcher_type``, so ``install`` swaps it afterwards."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

from .dispatcher import dispatcher_from_megatron, is_installed
from .inputs import check_inputs_together
from .row_stable import make_row_stable
from .supported import check_row_stable_supported, check_supported, megatron_field, warn_if_untested


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
            those GEMMs are row-stable, e.g. CPU bf16).

    Raises:
        ValueError: a setting we cannot honour (``check_supported``), or an EP group whose
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
    expected = list(megatron_field(moe_layer, "local_expert_indices", dispatcher.local_expert_indices))
    if dispatcher.local_expert_indices != expected:
        raise ValueError(f"EP group mismatch: the dispatcher's local experts {dispatcher.local_expert_indices} "
                         f"differ from the layer's local_expert_indices {expected}")
    moe_layer.token_dispatcher = dispatcher
    if row_stable_gemms:
        make_row_stable(moe_layer)
    check_inputs_together(moe_layer)
    return moe_layer


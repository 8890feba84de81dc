"""Our dispatchers inside megatron-core's ``MoELayer`` (0.16.1 through 0.19.2, written against
HEAD's 0.20 interface), and everything else that knows Megatron::

    from moe_dispatch.integrations.megatron import install
    layer = install(MoELayer(config, submodules, pg_collection=pg_collection))

    from moe_dispatch.integrations.megatron import DeterministicMoELayer, get_moe_module_spec
    spec = get_moe_module_spec(use_te=False, num_experts=64)      # Megatron's, MoELayer swapped
    layer_spec = deterministic_moe_spec(get_gpt_layer_local_spec(num_experts=64))  # any spec tree

    # Megatron-LM's own script (core_v0.19.0 and later), one flag:
    #   python pretrain_gpt.py ... --spec moe_dispatch.integrations.megatron deterministic_layer_spec

Release differences are detected from the installed package (attributes, signatures, spec
types), never from its version string. What is supported, and why, is in docs/megatron.md;
every unsupported setting raises a ValueError naming the field (``supported``).

Modules: ``supported`` (the checks, one accessor for Megatron's fields), ``config`` (a
TransformerConfig as our MoEConfig), ``dispatcher`` (the six-method interface around ours),
``install``, ``inputs`` (a bad input raised on every EP rank), ``row_stable`` (row-stable router
and expert GEMMs), ``specs`` (DeterministicMoELayer, spec helpers), ``state`` (expert state dicts
under Megatron's names), ``build`` (Megatron layers outside its training set-up) and ``check``
(``moe-dispatch check --megatron``). Importing this package imports no megatron-core.
"""
from __future__ import annotations

from typing import Any

from .config import megatron_moe_settings, moe_config_from_megatron
from .dispatcher import MegatronTokenDispatcher, dispatcher_from_megatron, is_installed
from .inputs import check_inputs_together
from .install import install
from .row_stable import make_row_stable

# deterministic_layer_spec*: real attributes, not lazy ones: Megatron-LM's --spec reads vars(module)[name].
from .specs import (
    deterministic_layer_spec,
    deterministic_layer_spec_fp8,
    deterministic_moe_layer_class,
    deterministic_moe_spec,
    get_moe_module_spec,
    megatron_default_layer_spec,
)
from .state import (
    from_megatron_grouped,
    from_megatron_sequential,
    load_megatron_state_dict,
    megatron_state_dict,
    to_megatron_grouped,
    to_megatron_sequential,
)
from .supported import (
    SUPPORTED_DISPATCHERS,
    TESTED_MEGATRON_CORE,
    check_graph_capture,
    check_row_stable_supported,
    check_supported,
    expert_layout,
    sync_free_obstacle,
    warn_if_untested,
)

__all__ = ["DeterministicMoELayer",  # noqa: F822  (built lazily, see __getattr__)
           "MegatronTokenDispatcher", "SUPPORTED_DISPATCHERS", "TESTED_MEGATRON_CORE", "check_graph_capture",
           "check_inputs_together", "check_row_stable_supported", "check_supported", "deterministic_layer_spec",
           "deterministic_layer_spec_fp8", "deterministic_moe_spec", "expert_layout",
           "dispatcher_from_megatron", "from_megatron_grouped", "from_megatron_sequential", "get_moe_module_spec",
           "install", "is_installed", "load_megatron_state_dict", "make_row_stable", "megatron_moe_settings",
           "megatron_default_layer_spec", "megatron_state_dict",
           "moe_config_from_megatron", "sync_free_obstacle", "to_megatron_grouped",
           "to_megatron_sequential", "warn_if_untested"]


def __getattr__(name: str) -> Any:  # PEP 562: DeterministicMoELayer is built lazily
    if name == "DeterministicMoELayer":
        return deterministic_moe_layer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

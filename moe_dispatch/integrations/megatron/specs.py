"""``DeterministicMoELayer`` (megatron-core's MoELayer with ``install`` applied at construction) and
the spec helpers that put it into Megatron's spec trees. The class is built on first use, so that
importing the package needs no megatron-core."""
from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from typing import Any, Optional

from .install import install
from .supported import check_supported, megatron_field

_MOE_LAYER_PATH = ("megatron.core.transformer.moe.moe_layer", "MoELayer")
# The package that exports DeterministicMoELayer (lazily, through its __getattr__).
_PACKAGE = __name__.rpartition(".")[0]


def _megatron_moe_layer() -> type:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return MoELayer


_CLASSES: dict = {}


def deterministic_moe_layer_class() -> type:
    """DeterministicMoELayer, built on first use (importing this package imports no megatron-core)."""
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
            that ``check_supported`` rejects.

            megatron-core 0.16 and 0.17 build a ModuleSpec MLP with ``pg_collection`` (and 0.17
            ``is_mtp_layer``) only when its module is MoELayer itself, and log "Unknown MLP type"
            otherwise: this class then gets Megatron's default process groups (the global parallel
            state, as MoELayer without pg_collection), and raises if their EP size differs from
            ``expert_model_parallel_size``. From 0.18 the spec is a partial that gets every argument."""

            def __init__(self, config: Any, submodules: Any = None, layer_number: Optional[int] = None,
                         pg_collection: Optional[Any] = None, is_mtp_layer: bool = False,
                         name: Optional[str] = None, row_stable_gemms: bool = True) -> None:
                check_supported(config, row_stable_gemms=row_stable_gemms)
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
                ep = megatron_field(config, "expert_model_parallel_size")
                if pg_collection is None and ep is not None and ep != self.token_dispatcher.ep_size:
                    # megatron-core <= 0.17's TransformerLayer passes pg_collection only to a spec
                    # whose module is MoELayer itself: without it Megatron's default groups are used.
                    raise ValueError(f"DeterministicMoELayer got no pg_collection, and Megatron's default EP group "
                                     f"has size {self.token_dispatcher.ep_size}, not expert_model_parallel_size={ep}: "
                                     "pass pg_collection, or initialise Megatron's parallel state to match")

        DeterministicMoELayer.__module__ = _PACKAGE
        DeterministicMoELayer.__qualname__ = "DeterministicMoELayer"
        _CLASSES["DeterministicMoELayer"] = DeterministicMoELayer
    return _CLASSES["DeterministicMoELayer"]


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
    deterministic = deterministic_moe_layer_class()
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
        module = megatron_field(node, "module")
        if _is_moe_layer(module, moe_layer):
            node.module = deterministic
            node.params = dict(megatron_field(node, "params") or {}, row_stable_gemms=row_stable_gemms)
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

"""``DeterministicMoELayer`` (megatron-core's MoELayer with ``install`` applied at construction) and
the spec helpers that put it into Megatron's spec trees, among them ``deterministic_layer_spec``
for Megatron-LM's own ``pretrain_gpt.py --spec``. The class is built on first use, so that
importing the package needs no megatron-core."""
from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import inspect
from typing import Any, Callable, Optional

from ...config import FP8_FORMATS
from .install import install
from .supported import check_fp8, check_quantize_weights_once, check_supported, megatron_field

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
            the installed release takes them), plus ``row_stable_gemms`` (default True) and
            ``fp8`` (default None: the layer's dtype on the wire; 'e4m3': our per-token FP8, each
            token's row quantised once with its own fp32 scale before the dispatch and both expert
            GEMMs in FP8) and ``quantize_weights_once`` (default False), passed on to ``install``
            (see there) and set through
            ``get_moe_module_spec`` / ``deterministic_moe_spec``; raises ValueError up front
            (before Megatron builds its own dispatcher) for the settings that ``check_supported``
            and ``check_fp8`` reject (an ``fp8`` outside ``FP8_FORMATS``, hidden or expert ffn
            sizes not multiples of 16, ``row_stable_gemms`` False with ``fp8``).

            megatron-core 0.16 and 0.17 build a ModuleSpec MLP with ``pg_collection`` (and 0.17
            ``is_mtp_layer``) only when its module is MoELayer itself, and log "Unknown MLP type"
            otherwise: this class then gets Megatron's default process groups (the global parallel
            state, as MoELayer without pg_collection), and raises if their EP size differs from
            ``expert_model_parallel_size``. From 0.18 the spec is a partial that gets every argument."""

            def __init__(self, config: Any, submodules: Any = None, layer_number: Optional[int] = None,
                         pg_collection: Optional[Any] = None, is_mtp_layer: bool = False,
                         name: Optional[str] = None, row_stable_gemms: bool = True,
                         fp8: Optional[str] = None, quantize_weights_once: bool = False) -> None:
                check_supported(config, row_stable_gemms=row_stable_gemms)
                check_fp8(config, fp8, row_stable_gemms)
                check_quantize_weights_once(fp8, quantize_weights_once)
                extra = {}
                for key, value, default in (("is_mtp_layer", is_mtp_layer, False), ("name", name, None)):
                    if key in accepted:
                        extra[key] = value
                    elif value != default:
                        raise TypeError(f"DeterministicMoELayer: {key}={value!r} needs a megatron-core whose "
                                        f"MoELayer takes {key} (this one does not)")
                super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                                 pg_collection=pg_collection, **extra)
                install(self, pg_collection, row_stable_gemms=row_stable_gemms, fp8=fp8,
                        quantize_weights_once=quantize_weights_once)
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


def _check_fp8_value(fp8: Any, where: str) -> None:
    """The spec helpers' early check of ``fp8`` (the value only; the layer checks the config)."""
    if fp8 is not None and (not isinstance(fp8, str) or fp8 not in FP8_FORMATS):
        raise ValueError(f"{where}: fp8={fp8!r} is not one of {tuple(FP8_FORMATS)} (or None)")


def deterministic_moe_spec(spec: Any, row_stable_gemms: bool = True, fp8: Optional[str] = None,
                           quantize_weights_once: bool = False) -> Any:
    """A copy of a Megatron spec tree where every MoELayer is DeterministicMoELayer, built with
    ``row_stable_gemms``, ``fp8`` and ``quantize_weights_once`` (see ``install``).

    ``fp8``: None (default: the layers dispatch and compute in the model's dtype, as before), or
    'e4m3' (a key of ``moe_dispatch.config.FP8_FORMATS``): every MoE layer of the tree runs our
    per-token FP8 (each token's [hidden] row quantised once before the dispatch with its own fp32
    scale, FP8 rows and scales on the wire, both expert GEMMs in FP8, the combine the fp32
    weighted sum; the rest of the model keeps its dtype). A value outside ``FP8_FORMATS`` raises
    ValueError here; the layers check the rest when built (hidden and expert ffn sizes multiples
    of 16, the TransformerConfig's own ``fp8`` None, ``row_stable_gemms`` True).

    ``spec``: a layer spec, a block spec, a list of them, a TransformerBlockSubmodules, or an MoE
    spec itself. Both kinds of MoE spec are handled: a ``ModuleSpec(module=MoELayer, ...)``
    (megatron-core <= 0.17) and a ``functools.partial(MoELayer, submodules=...)`` (0.18+); each
    keeps its kind."""
    _check_fp8_value(fp8, "deterministic_moe_spec")
    check_quantize_weights_once(fp8, quantize_weights_once)
    moe_layer = _megatron_moe_layer()
    deterministic = deterministic_moe_layer_class()
    options = dict(row_stable_gemms=row_stable_gemms, fp8=fp8, quantize_weights_once=quantize_weights_once)
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
                replaced = functools.partial(deterministic, *args, **{**keywords, **options})
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
            node.params = dict(megatron_field(node, "params") or {}, **options)
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            for f in dataclasses.fields(node):
                value = getattr(node, f.name)
                new = visit(value)
                if new is not value:
                    object.__setattr__(node, f.name, new)  # a deep copy: frozen dataclasses too
        return node

    return visit(copy.deepcopy(spec))


def get_moe_module_spec(*args: Any, row_stable_gemms: bool = True, fp8: Optional[str] = None,
                        quantize_weights_once: bool = False, **kwargs: Any) -> Any:
    """megatron.core.models.gpt.moe_module_specs.get_moe_module_spec (same arguments, same kind of
    spec: a ModuleSpec up to 0.17, a functools.partial from 0.18), with the module
    DeterministicMoELayer built with ``row_stable_gemms``, ``fp8`` (None by default, or 'e4m3':
    our per-token FP8 dispatch and expert GEMMs) and ``quantize_weights_once``; see
    ``deterministic_moe_spec`` and ``install``. A bad ``fp8`` or ``quantize_weights_once`` raises
    ValueError before Megatron's spec is built."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec as megatron_spec

    _check_fp8_value(fp8, "get_moe_module_spec")
    check_quantize_weights_once(fp8, quantize_weights_once)
    return deterministic_moe_spec(megatron_spec(*args, **kwargs), row_stable_gemms, fp8, quantize_weights_once)


# Where Megatron-LM keeps the spec that pretrain_gpt.py builds when --spec is not given (core_v0.19.0
# and HEAD: megatron/training/models/gpt.py, called as default_layer_spec(config, vp_stage)).
DEFAULT_LAYER_SPEC = ("megatron.training.models.gpt", "default_layer_spec")
_GPT_BUILDERS_EDIT = ("With Megatron-LM core_v0.16.x to core_v0.18.x, pretrain_gpt.py builds the spec in "
                      "gpt_builders.gpt_builder, where --spec takes a spec object only: add "
                      "`transformer_layer_spec = deterministic_moe_spec(transformer_layer_spec)` there "
                      "(docs/megatron.md, 'Megatron-LM core_v0.16 to core_v0.18')")


def _megatron_version() -> str:
    try:
        from megatron.core import package_info

        return f"megatron-core {package_info.__version__}"
    except ImportError:
        return "no megatron-core"


def megatron_default_layer_spec() -> Callable[..., Any]:
    """Megatron-LM's ``default_layer_spec(config, vp_stage)`` (``DEFAULT_LAYER_SPEC``: in
    megatron/training/models/gpt.py from core_v0.19.0 on). Raises ImportError naming the installed
    megatron-core and the way for older Megatron-LM when it is not there (megatron-core alone has no
    ``megatron.training``; core_v0.16 to 0.18 have no ``megatron.training.models``)."""
    path, name = DEFAULT_LAYER_SPEC
    try:
        module = importlib.import_module(path)
    except ModuleNotFoundError as exc:
        # either the module is not there (megatron-core alone, Megatron-LM before core_v0.19), or
        # importing Megatron-LM's training package needs a module this environment lacks (yaml, ...)
        missing = (f"{exc.name} is not there" if exc.name and path.startswith(exc.name)
                   else f"importing {path} failed: {exc}")
        raise ImportError(f"deterministic_layer_spec needs Megatron-LM's {path}.{name} (Megatron-LM core_v0.19.0 "
                          f"and later, its training package beside megatron.core); {_megatron_version()} is "
                          f"installed and {missing}. {_GPT_BUILDERS_EDIT}") from exc
    spec = getattr(module, name, None)
    if not callable(spec):
        raise ImportError(f"deterministic_layer_spec: {path} has no {name} ({_megatron_version()}); "
                          f"{_GPT_BUILDERS_EDIT}")
    return spec


def deterministic_layer_spec(config: Any, vp_stage: Optional[int] = None) -> Any:
    """Megatron-LM's ``default_layer_spec(config, vp_stage)`` with every MoELayer in it
    DeterministicMoELayer (``deterministic_moe_spec``): the spec that Megatron-LM's own
    ``pretrain_gpt.py`` builds, with our dispatcher and row-stable GEMMs in its MoE layers::

        python pretrain_gpt.py ... --spec moe_dispatch.integrations.megatron deterministic_layer_spec

    Megatron-LM core_v0.19.0 and later call a callable ``--spec`` as ``f(config, vp_stage=...)``
    with their ``GPTModelConfig`` (megatron/training/models/gpt.py). Every layer kind of that spec
    works: ``--transformer-impl local`` or ``transformer_engine`` (SequentialMLP or, with
    ``--moe-grouped-gemm``, TEGroupedMLP experts), a decoder block spec with dense and MoE layers
    mixed by ``--moe-layer-freq``. Dense layers, attention and TE's FP8 recipe are Megatron's.
    Raises ImportError (``megatron_default_layer_spec``) where Megatron-LM's training package is
    absent or older; there, wrap the spec in gpt_builders.py (docs/megatron.md)."""
    return deterministic_moe_spec(megatron_default_layer_spec()(config, vp_stage))


def deterministic_layer_spec_fp8(config: Any, vp_stage: Optional[int] = None) -> Any:
    """``deterministic_layer_spec`` with our per-token FP8 in every MoE layer (``fp8='e4m3'``,
    ``install(fp8=...)``): ``--spec moe_dispatch.integrations.megatron deterministic_layer_spec_fp8``.
    TE's own ``--fp8-format`` / ``--fp8-recipe`` may be set beside it: they stay on the dense layers."""
    return deterministic_moe_spec(megatron_default_layer_spec()(config, vp_stage), fp8="e4m3")

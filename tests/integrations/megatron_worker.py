"""Code that runs on the spawned gloo ranks for the Megatron plug-in tests.

megatron-core's MoELayer (0.16.1 through 0.19.2) (SequentialMLP experts, no TE) on 2 CPU ranks, built with an
explicit ProcessGroupCollection so that one spawn holds an EP-2 layer (both ranks) and an EP-1
layer (each rank alone) side by side. Every global expert's weights depend only on its id and the
router's on a fixed seed, so the layers of every EP size and dispatcher are the same model.

Global batch: G = 256 tokens. EP 2: rank r holds tokens [128 r, 128 r + 128) as [64, 2, H];
EP 1: each rank holds all 256 as [128, 2, H]. Token index = s * B + b (Megatron's flattening).
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from moe_dispatch.config import DISPATCHER_KINDS

H, FFN, E, K = 64, 32, 8, 2
G, B = 256, 2
TRUNC = 90  # truncation: tokens >= TRUNC (of each rank's batch) zeroed
KINDS = DISPATCHER_KINDS
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _setup() -> None:
    from tests.megatron_cpu import apply_cpu_shims

    warnings.filterwarnings("ignore")
    apply_cpu_shims()


def _pg(ep_group, single):
    from moe_dispatch.integrations.megatron.build import process_groups

    return process_groups(ep_group, single)


def _config(kind: str, dtype: torch.dtype, ep: int, **extra):
    from moe_dispatch.integrations.megatron.build import moe_transformer_config

    return moe_transformer_config(H, FFN, E, K, kind, dtype, ep, **extra)


def _build(cfg, pg, ours_from_spec: bool, row_stable_gemms: bool = False):
    """Megatron's MoELayer (ours_from_spec: DeterministicMoELayer built through our spec helper,
    with or without our row-stable GEMMs), with the deterministic weights."""
    from moe_dispatch.integrations.megatron.build import build_moe_layer

    return _seed(build_moe_layer(cfg, pg, ours=ours_from_spec, row_stable_gemms=row_stable_gemms))


def _seed(layer):
    """The deterministic weights (router: seed 7; expert e: seed 1000 + e) and the experts' input
    hook, on a layer built by ``_build`` or from a spec; returns the layer."""
    dtype = layer.config.params_dtype
    with torch.no_grad():
        gen = torch.Generator().manual_seed(7)
        layer.router.weight.copy_(torch.randn(E, H, generator=gen) * H ** -0.5)
        for i, expert in enumerate(layer.experts.local_experts):
            gen = torch.Generator().manual_seed(1000 + layer.local_expert_indices[i])
            expert.linear_fc1.weight.copy_((torch.randn(FFN, H, generator=gen) * H ** -0.5).to(dtype))
            expert.linear_fc2.weight.copy_((torch.randn(H, FFN, generator=gen) * FFN ** -0.5).to(dtype))
    layer.experts.register_forward_pre_hook(_note_expert_input)
    return layer


def _note_expert_input(experts, args) -> None:
    """Forward pre-hook on the experts: (permuted_probs dtype, fewest rows of a local expert)."""
    _, tokens_per_expert, permuted_probs = args
    experts.seen = (str(permuted_probs.dtype), int(min(torch.as_tensor(tokens_per_expert).tolist())))


def _tokens(dtype: torch.dtype, variant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, dy) for all G tokens [G, H]; 'trunc' zeroes tokens >= TRUNC of each EP-2 rank's share."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(G, H, generator=gen).to(dtype)
    dy = torch.randn(G, H, generator=gen).to(dtype)
    if variant == "trunc":
        for r in range(2):
            x[r * 128 + TRUNC:(r + 1) * 128] = 0
    return x, dy


def _step(layer, x: torch.Tensor, dy: torch.Tensor) -> dict:
    """One forward + backward of Megatron's MoELayer on x [T, H] (fed as [T / B, B, H])."""
    layer.zero_grad(set_to_none=True)
    xi = x.reshape(-1, B, H).clone().requires_grad_()
    out, bias = layer(xi)
    assert bias is None and out.shape == xi.shape
    out.backward(dy.reshape(out.shape))
    experts = {}
    for i, expert in enumerate(layer.experts.local_experts):
        experts[layer.local_expert_indices[i]] = (expert.linear_fc1.weight.grad.clone(),
                                                  expert.linear_fc2.weight.grad.clone())
    # clone: Megatron's allgather dispatcher may leave x.grad a view of a reused global buffer
    probs_dtype, min_rows = layer.experts.seen
    return dict(out=out.detach().reshape(-1, H).clone(), gx=xi.grad.reshape(-1, H).clone(),
                router=layer.router.weight.grad.clone(), experts=experts, probs_dtype=probs_dtype,
                min_rows=min_rows)


def assert_equal(a: torch.Tensor, b: torch.Tensor, what) -> None:
    """Same dtype, shape and bits (test-side check of the records the workers return)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a, b), (what, (a.double() - b.double()).abs().max().item())


def assert_steps_equal(a: dict, b: dict, what, contiguous_expert_grads: bool = False) -> None:
    """Two ``_step`` records bitwise equal: output, input and router gradients, and both expert
    weight gradients of the 8 experts (with ``contiguous_expert_grads``, also contiguous)."""
    for field in ("out", "gx", "router"):
        assert_equal(a[field], b[field], (what, field))
    assert sorted(a["experts"]) == sorted(b["experts"]) == list(range(8))
    for e in a["experts"]:
        for i in range(2):
            assert_equal(a["experts"][e][i], b["experts"][e][i], (what, "expert", e, i))
            if contiguous_expert_grads:
                assert a["experts"][e][i].is_contiguous()


def plugin_worker(rank: int, world_size: int) -> dict:
    assert world_size == 2
    _setup()
    from moe_dispatch.integrations.megatron import (
        dispatcher_from_megatron,
        install,
        is_installed,
        moe_config_from_megatron,
    )

    singles = [dist.new_group([r]) for r in range(world_size)]
    world = dist.group.WORLD
    pg2, pg1 = _pg(world, singles[rank]), _pg(singles[rank], singles[rank])
    mine = slice(rank * 128, (rank + 1) * 128)
    records = {}
    for dname, dtype in DTYPES.items():
        full_x, full_dy = _tokens(dtype, "full")
        trunc_x, _ = _tokens(dtype, "trunc")
        for kind in KINDS:
            rec = {}
            layer = _build(_config(kind, dtype, 2), pg2, ours_from_spec=False)
            rec["stock"] = _step(layer, full_x[mine], full_dy[mine])
            assert not is_installed(layer)
            # Megatron's token_dispatcher replaced by hand: the probs must be applied once.
            layer.token_dispatcher = dispatcher_from_megatron(layer.config, pg2)
            rec["replaced"] = _step(layer, full_x[mine], full_dy[mine])
            # Negative control: our default mode (probs in the combine) under Megatron's experts,
            # which multiply the probs too: applied twice.
            layer.token_dispatcher = dispatcher_from_megatron(moe_config_from_megatron(layer.config), pg2)
            rec["twice"] = _step(layer, full_x[mine], full_dy[mine])
            # Dispatcher only: Megatron's own GEMMs, so results compare bitwise with its stock layer.
            assert install(layer, row_stable_gemms=False) is layer and is_installed(layer)
            rec["ours"] = _step(layer, full_x[mine], full_dy[mine])
            assert install(layer, row_stable_gemms=False) is layer and is_installed(layer)  # twice is harmless
            rec["trunc"] = _step(layer, trunc_x[mine], full_dy[mine])
            rec["same"] = _step(layer, full_x[:128], full_dy[:128])  # identical tokens on both ranks
            layer1 = _build(_config(kind, dtype, 1), pg1, ours_from_spec=True)
            assert is_installed(layer1) and type(layer1).__name__ == "DeterministicMoELayer"
            rec["ep1"] = _step(layer1, full_x, full_dy)  # each rank alone, all G tokens
            records[(dname, kind)] = rec
    records["extra"] = _extra_cases(rank, pg2, world, singles)
    records["row_stable"] = _row_stable_cases(rank, pg2, pg1)
    records["spec_fp8"] = _spec_fp8_cases(rank, pg2, pg1)
    return records


def _spec_fp8_cases(rank: int, pg2, pg1) -> dict:
    """The spec helpers' ``fp8``: per (dtype, dispatcher), EP 2, a DeterministicMoELayer built from
    ``get_moe_module_spec(..., fp8="e4m3")`` and a stock MoELayer with ``install(layer, fp8="e4m3")``,
    the same weights and tokens (their steps, and the spec layer's dispatcher config fp8); and the
    errors of a bad fp8 value (the spec helpers, and the class itself on an EP-1 config)."""
    from moe_dispatch.integrations.megatron import (
        deterministic_moe_layer_class,
        deterministic_moe_spec,
        get_moe_module_spec,
        install,
    )
    from moe_dispatch.integrations.megatron.build import build_from_spec

    mine = slice(rank * 128, (rank + 1) * 128)
    records = {}
    for dname, dtype in DTYPES.items():
        x, dy = _tokens(dtype, "full")
        for kind in KINDS:
            cfg = _config(kind, dtype, 2)
            spec = get_moe_module_spec(use_te=False, num_experts=E, fp8="e4m3")
            layer = _seed(build_from_spec(spec, config=cfg, pg_collection=pg2).train())
            stock = install(_build(_config(kind, dtype, 2), pg2, ours_from_spec=False), pg2, fp8="e4m3")
            records[(dname, kind)] = dict(spec=_step(layer, x[mine], dy[mine]), install=_step(stock, x[mine], dy[mine]),
                                          spec_fp8=layer.token_dispatcher.config.fp8, spec_class=type(layer).__name__,
                                          default_fp8=_default_spec_fp8(cfg, pg2))

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg1 = _config("alltoall", torch.bfloat16, 1)
    submodules = get_moe_module_spec(use_te=False, num_experts=E)
    submodules = submodules.submodules if hasattr(submodules, "submodules") else submodules.keywords["submodules"]
    records["errors"] = {
        "get_moe_module_spec": outcome(lambda: get_moe_module_spec(use_te=False, num_experts=E, fp8="e5m2")),
        "deterministic_moe_spec": outcome(lambda: deterministic_moe_spec(get_gpt_layer_local_spec(num_experts=E),
                                                                         fp8="E4M3")),
        "class": outcome(lambda: deterministic_moe_layer_class()(config=cfg1, submodules=submodules,
                                                                  pg_collection=pg1, fp8="e5m2")),
        "class_hidden": outcome(lambda: deterministic_moe_layer_class()(
            config=_config("alltoall", torch.bfloat16, 1, hidden_size=40), submodules=submodules,
            pg_collection=pg1, fp8="e4m3")),
        "get_moe_module_spec_once": outcome(lambda: get_moe_module_spec(use_te=False, num_experts=E,
                                                                        quantize_weights_once=True)),
        "deterministic_moe_spec_once": outcome(lambda: deterministic_moe_spec(
            get_gpt_layer_local_spec(num_experts=E), fp8="e4m3", quantize_weights_once="yes")),
        "class_once": outcome(lambda: deterministic_moe_layer_class()(config=cfg1, submodules=submodules,
                                                                       pg_collection=pg1, quantize_weights_once=True)),
    }
    kept = deterministic_moe_layer_class()(config=cfg1, submodules=submodules, pg_collection=pg1, fp8="e4m3",
                                           quantize_weights_once=True)
    records["class_once_passed_on"] = kept.experts._moe_dispatch_quantize_weights_once
    return records


def outcome(fn) -> tuple[str, str]:
    """("ok", "") if fn() returns, ("ValueError", its message) if it raises one (others propagate)."""
    try:
        fn()
        return ("ok", "")
    except ValueError as exc:
        return ("ValueError", str(exc))


def _default_spec_fp8(cfg, pg):
    """The dispatcher config's fp8 of a layer from the spec helper without ``fp8`` (the default)."""
    from moe_dispatch.integrations.megatron import get_moe_module_spec
    from moe_dispatch.integrations.megatron.build import build_from_spec

    return build_from_spec(get_moe_module_spec(use_te=False, num_experts=E), config=cfg,
                           pg_collection=pg).token_dispatcher.config.fp8


def _row_stable_cases(rank: int, pg2, pg1) -> dict:
    """install(row_stable_gemms=True), the default: Megatron's router gating and SequentialMLP GEMMs
    swapped for ours. Per (dtype, dispatcher): stock, ours at EP 2, truncated, each rank's first
    tokens (B = 2) alone, EP 1 (DeterministicMoELayer from the spec, default row-stable); and a negative
    control: the dispatcher alone (Megatron's GEMMs) with one token alone."""
    from moe_dispatch.integrations.megatron import install

    mine = slice(rank * 128, (rank + 1) * 128)
    records = {}
    for dname, dtype in DTYPES.items():
        full_x, full_dy = _tokens(dtype, "full")
        trunc_x, _ = _tokens(dtype, "trunc")
        first = slice(rank * 128, rank * 128 + B)  # one sequence position: B tokens
        for kind in KINDS:
            rec = {}
            layer = _build(_config(kind, dtype, 2), pg2, ours_from_spec=False)
            rec["stock"] = _step(layer, full_x[mine], full_dy[mine])
            install(layer, row_stable_gemms=False)
            rec["dispatcher_only_alone"] = _step(layer, full_x[first], full_dy[first])
            install(layer)
            assert layer._moe_dispatch_row_stable
            rec["ours"] = _step(layer, full_x[mine], full_dy[mine])
            rec["trunc"] = _step(layer, trunc_x[mine], full_dy[mine])
            rec["alone"] = _step(layer, full_x[first], full_dy[first])
            layer1 = _build(_config(kind, dtype, 1), pg1, ours_from_spec=True, row_stable_gemms=True)
            assert layer1._moe_dispatch_row_stable
            rec["ep1"] = _step(layer1, full_x, full_dy)
            records[(dname, kind)] = rec
    return records


def _extra_cases(rank: int, pg2, world, singles) -> dict:
    """bf16 and fp64 routers and pad-to-capacity (alltoall, bf16), stock vs ours; install errors."""
    from types import SimpleNamespace

    from megatron.core.process_groups_config import ProcessGroupCollection

    from moe_dispatch.integrations.megatron import install

    mine = slice(rank * 128, (rank + 1) * 128)
    x, dy = _tokens(torch.bfloat16, "full")
    out = {}
    cases = {"router-bf16": dict(moe_router_dtype=None), "router-fp64": dict(moe_router_dtype="fp64"),
             "capacity-pad": dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)}
    for name, extra in cases.items():
        layer = _build(_config("alltoall", torch.bfloat16, 2, **extra), pg2, ours_from_spec=False)
        rec = {"stock": _step(layer, x[mine], dy[mine])}
        install(layer, row_stable_gemms=False)
        rec["ours"] = _step(layer, x[mine], dy[mine])
        rec["same"] = _step(layer, x[:128], dy[:128])
        out[name] = rec

    base = _config("alltoall", torch.bfloat16, 2)
    flex = SimpleNamespace(config=_config("alltoall", torch.bfloat16, 2, moe_token_dispatcher_type="flex"))
    out["flex"] = outcome(lambda: install(flex))
    etp = SimpleNamespace(config=_config("alltoall", torch.bfloat16, 1, tensor_model_parallel_size=2,
                                         expert_tensor_parallel_size=2, sequence_parallel=True))
    out["etp_config"] = outcome(lambda: install(etp))
    # A config that claims ETP 1 on a pg_collection whose expt_tp group spans both ranks.
    layer = _build(base, pg2, ours_from_spec=False)
    bad_pg = ProcessGroupCollection(ep=singles[rank], expt_tp=world, tp_ep=world)
    out["etp_groups"] = outcome(lambda: install(layer, bad_pg))
    out["ep_mismatch"] = outcome(lambda: install(layer, ProcessGroupCollection(ep=singles[rank])))
    overlap = SimpleNamespace(config=_config("alltoall", torch.bfloat16, 2, moe_shared_expert_intermediate_size=32,
                                             moe_shared_expert_overlap=True))
    out["shared_overlap"] = outcome(lambda: install(overlap))
    out["not_sequential"] = outcome(lambda: install(SimpleNamespace(config=base, experts=None)))
    silu = _build(_config("alltoall", torch.bfloat16, 2, activation_func=torch.nn.functional.silu), pg2, False)
    out["silu_not_gated"] = outcome(lambda: install(silu))
    # The spec helper swaps MoELayer anywhere in a spec tree (here a GPT layer spec).
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from moe_dispatch.integrations.megatron import deterministic_moe_spec

    mlp = deterministic_moe_spec(get_gpt_layer_local_spec(num_experts=E)).submodules.mlp
    # A ModuleSpec up to megatron-core 0.17, a functools.partial from 0.18 on.
    out["gpt_spec_mlp"] = (mlp.module if hasattr(mlp, "module") else mlp.func).__name__
    return out

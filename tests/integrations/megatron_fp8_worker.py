"""Rank bodies of tests/integrations/test_megatron_fp8.py: ``install(layer, fp8="e4m3")`` on
megatron-core's MoELayer (SequentialMLP, no TE) beside our own ``MoELayer(MoEConfig(fp8="e4m3"))``
with the same weights, on 2 CPU gloo ranks (one spawn: EP 2 over both ranks, EP 1 on each alone).

Global batch: G = 64 tokens; EP 2: rank r holds tokens [32 r, 32 r + 32) (fed to Megatron as
[16, 2, H]); EP 1: each rank holds all 64. The shapes, weights and tokens are megatron_worker.py's
(hidden 64, ffn 32, 8 experts, top-2, fp32 router); the router's weights are rounded to the
params dtype, so that our router (whose weight has that dtype) holds the same values.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from .megatron_worker import DTYPES, KINDS, H, _build, _config, _pg, _setup, outcome

G, B = 64, 2
FP8 = "e4m3"
BAD_VALUES = ("e5m2", "E4M3", True)


def tokens(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, dy) of all G tokens [G, H]."""
    gen = torch.Generator().manual_seed(21)
    return torch.randn(G, H, generator=gen).to(dtype), torch.randn(G, H, generator=gen).to(dtype)


def _megatron(kind: str, dtype: torch.dtype, ep: int, pg) -> object:
    layer = _build(_config(kind, dtype, ep), pg, ours_from_spec=False)
    with torch.no_grad():
        layer.router.weight.copy_(layer.router.weight.to(dtype))
    layer.experts.register_forward_pre_hook(_note_rows)
    return layer


def _note_rows(experts, args) -> None:
    """What the experts were handed: (dtype, width) of the dispatched rows."""
    experts.rows_seen = (str(args[0].dtype), int(args[0].shape[1]))


def _megatron_step(layer, x: torch.Tensor, dy: torch.Tensor) -> dict:
    """One forward + backward of Megatron's layer on x [T, H] (fed as [T / B, B, H])."""
    layer.zero_grad(set_to_none=True)
    out, gx = _step_accumulating(layer, x, dy)
    experts = {layer.local_expert_indices[i]: (e.linear_fc1.weight.grad.clone(), e.linear_fc2.weight.grad.clone())
               for i, e in enumerate(layer.experts.local_experts)}
    return dict(out=out.clone(), gx=gx.clone(), experts=experts,
                rows=layer.experts.rows_seen, wire_fp8=layer.token_dispatcher.config.fp8)


def _ours_step(megatron_layer, group, x: torch.Tensor, dy: torch.Tensor) -> dict:
    """Our MoELayer(MoEConfig(fp8="e4m3")) from the Megatron layer's config, with its weights;
    expert weight gradients in Megatron's [out, in] layout."""
    from moe_dispatch import MoELayer
    from moe_dispatch.integrations.megatron import moe_config_from_megatron

    layer = MoELayer(moe_config_from_megatron(megatron_layer.config, fp8=FP8), group, layer_index=0).to(x.device)
    assert layer.experts.local_expert_offset == megatron_layer.local_expert_indices[0]
    with torch.no_grad():
        layer.router.weight.copy_(megatron_layer.router.weight)
        for i, e in enumerate(megatron_layer.experts.local_experts):
            layer.experts.weight1[i].copy_(e.linear_fc1.weight.t())
            layer.experts.weight2[i].copy_(e.linear_fc2.weight.t())
    xi = x.clone().requires_grad_()
    out = layer(xi)
    out.backward(dy)
    first = layer.experts.local_expert_offset
    w1, w2 = layer.experts.weight1.grad, layer.experts.weight2.grad
    experts = {first + i: (w1[i].t().contiguous(), w2[i].t().contiguous())
               for i in range(layer.experts.num_local_experts)}
    return dict(out=out.detach().clone(), gx=xi.grad.clone(), experts=experts)


def _step_accumulating(layer, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward + backward of x [T, H], the weight gradients accumulating; (out, input grad)."""
    xi = x.reshape(-1, B, H).clone().requires_grad_()
    out, bias = layer(xi)
    assert bias is None
    out.backward(dy.reshape(out.shape))
    return out.detach().reshape(-1, H), xi.grad.reshape(-1, H)


def _expert_grads(layer) -> list[torch.Tensor]:
    return [w.grad.clone() for e in layer.experts.local_experts for w in (e.linear_fc1.weight, e.linear_fc2.weight)]


def quantised_once(kind: str, dtype: torch.dtype, pg, x: torch.Tensor, dy: torch.Tensor) -> dict:
    """``install(fp8=..., quantize_weights_once=True)`` beside per-forward quantisation, same weights:
    two micro-batches accumulating, an optimizer step (SGD on both), a third micro-batch, an
    in-place weight change (copy_ on both), a fourth, a write autograd does not count
    (``p.data.copy_`` on both: no version moves), a fifth. Per phase: the outputs, input gradients and
    accumulated expert weight gradients bitwise alike, and how many times the kept layer quantised
    a weight (``quantize_weight`` calls)."""
    import moe_dispatch.experts as F  # the face the adapter imports quantize_weight from, at each call
    from moe_dispatch.integrations.megatron import install

    calls = []
    original = F.quantize_weight

    def counting(w, fp8_dtype=torch.float8_e4m3fn):
        calls.append(tuple(w.shape))
        return original(w, fp8_dtype)

    once = install(_megatron(kind, dtype, 1, pg), pg, fp8=FP8, quantize_weights_once=True).to(x.device)
    per_call = install(_megatron(kind, dtype, 1, pg), pg, fp8=FP8).to(x.device)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (once, per_call)]
    half = x.shape[0] // 2
    out = {}
    F.quantize_weight = counting
    try:
        for phase, batches in (("micro-batches 1 and 2", (slice(0, half), slice(half, None))),
                               ("after an optimizer step", (slice(0, half),)),
                               ("after copy_ into a weight", (slice(half, None),)),
                               ("after p.data.copy_ into a weight", (slice(0, half),))):
            if phase == "after an optimizer step":
                for opt in optimizers:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            if phase == "after copy_ into a weight":
                for m in (once, per_call):
                    m.zero_grad(set_to_none=True)
                    with torch.no_grad():
                        m.experts.local_experts[1].linear_fc2.weight.mul_(0.5)
            if phase == "after p.data.copy_ into a weight":
                for m in (once, per_call):
                    m.zero_grad(set_to_none=True)
                    w = m.experts.local_experts[0].linear_fc1.weight
                    w.data.copy_(w.detach() * -0.75)
            before = len(calls)
            same = True
            for rows in batches:
                a = _step_accumulating(once, x[rows], dy[rows])
                calls_once = len(calls)
                b = _step_accumulating(per_call, x[rows], dy[rows])
                del calls[calls_once:]  # count the kept layer's quantisations only
                same = same and all(torch.equal(u, v) for u, v in zip(a, b))
            grads_same = all(torch.equal(u, v) for u, v in zip(_expert_grads(once), _expert_grads(per_call)))
            out[phase] = dict(same=same, grads_same=grads_same, quantised=len(calls) - before)
    finally:
        F.quantize_weight = original
    return out


def _errors(rank: int, pg2, pg1) -> dict:
    """install()'s refusals; rank 0 alone tries a bad value on the EP-2 layer first (the other rank
    waits in a barrier): an error raised after a collective would hang there instead."""
    from moe_dispatch.integrations.megatron import install

    dtype = torch.bfloat16
    out = {}
    layer2 = _megatron("alltoall", dtype, 2, pg2)
    if rank == 0:
        out["rank0_alone"] = outcome(lambda: install(layer2, fp8="e5m2"))
    dist.barrier()
    layer = _megatron("alltoall", dtype, 1, pg1)
    for value in BAD_VALUES:
        out[("value", value)] = outcome(lambda value=value: install(layer, fp8=value))
    out["row_stable_gemms"] = outcome(lambda: install(layer, row_stable_gemms=False, fp8=FP8))
    out["sync_free"] = outcome(lambda: install(layer2, sync_free=True, fp8=FP8))  # EP 2: as without FP8
    out["ffn"] = outcome(lambda: install(SimpleNamespace(config=_config("alltoall", dtype, 1, moe_ffn_hidden_size=24,
                                                                         ffn_hidden_size=24)), fp8=FP8))
    out["hidden"] = outcome(lambda: install(SimpleNamespace(config=_config("alltoall", dtype, 1, hidden_size=40)),
                                             fp8=FP8))
    graphs = _megatron("alltoall", dtype, 1, pg1)
    graphs.config.cuda_graph_impl, graphs.config.cuda_graph_scope = "local", "moe"  # the whole MoE layer
    out["cuda_graphs"] = outcome(lambda: install(graphs, fp8=FP8))  # EP 1: sync-free, so it may capture
    out["cuda_graphs_sync_free"] = graphs.token_dispatcher.config.sync_free
    te = _megatron("alltoall", dtype, 1, pg1)
    te.config.fp8 = "hybrid"  # Megatron's TE FP8 (--fp8-format hybrid), set after the config's checks
    out["te_fp8"] = outcome(lambda: install(te))  # TE's recipe stays on the dense layers: accepted
    out["te_fp8_and_ours"] = outcome(lambda: install(te, fp8=FP8))
    te.config.fp8_param = True  # --fp8-param-gather: TE's FP8 weights, which our GEMMs cannot read
    out["te_fp8_param"] = outcome(lambda: install(te, fp8=FP8))
    te.config.fp8_param = False
    out["none_after_fp8"] = outcome(lambda: install(layer, fp8=None))  # fp8=None: no FP8 checks
    out["once_without_fp8"] = outcome(lambda: install(layer, quantize_weights_once=True))
    out["once_not_bool"] = outcome(lambda: install(layer, fp8=FP8, quantize_weights_once=1))
    return out


def fp8_worker(rank: int, world_size: int) -> dict:
    assert world_size == 2
    _setup()
    from moe_dispatch.integrations.megatron import install

    singles = [dist.new_group([r]) for r in range(world_size)]
    world = dist.group.WORLD
    pg2, pg1 = _pg(world, singles[rank]), _pg(singles[rank], singles[rank])
    mine = slice(rank * (G // 2), (rank + 1) * (G // 2))
    records = {}
    for dname, dtype in DTYPES.items():
        x, dy = tokens(dtype)
        for kind in KINDS:
            rec = {}
            layer2 = _megatron(kind, dtype, 2, pg2)
            install(layer2)
            rec["megatron_bf16_wire"] = _megatron_step(layer2, x[mine], dy[mine])  # fp8=None: Megatron's dtype
            install(layer2, fp8=FP8)
            rec["megatron_ep2"] = _megatron_step(layer2, x[mine], dy[mine])
            rec["ours_ep2"] = _ours_step(layer2, world, x[mine], dy[mine])
            layer2.config.fp8_wgrad = False  # Megatron's --no-fp8-wgrad: the weight gradients in the tokens' dtype
            rec["megatron_ep2_wide_wgrad"] = _megatron_step(layer2, x[mine], dy[mine])
            rec["ours_ep2_wide_wgrad"] = _ours_step(layer2, world, x[mine], dy[mine])
            layer2.config.fp8_wgrad = True
            layer1 = install(_megatron(kind, dtype, 1, pg1), fp8=FP8)
            rec["megatron_ep1"] = _megatron_step(layer1, x, dy)
            rec["ours_ep1"] = _ours_step(layer1, singles[rank], x, dy)
            synced = install(_megatron(kind, dtype, 1, pg1), fp8=FP8, sync_free=True)
            assert synced.token_dispatcher.config.sync_free
            rec["megatron_ep1_sync_free"] = _megatron_step(synced, x, dy)
            if kind == "alltoall":
                rec["quantised_once"] = quantised_once(kind, dtype, pg1, x, dy)
            records[(dname, kind)] = rec
    records["errors"] = _errors(rank, pg2, pg1)
    return records


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_to_cpu(v) for v in value)
    return value


def gpu_fp8_worker(rank: int, world_size: int) -> dict:
    """CUDA, one rank (nccl), EP 1, bf16 (the FP8 kernel's only output): per dispatcher kind, the
    installed layer's step and our layer's, then both with TransformerConfig.fp8_wgrad=False, moved
    to the CPU."""
    assert world_size == 1
    import warnings

    warnings.filterwarnings("ignore")  # Megatron's import-time notices (no TE, no apex, ...)
    from moe_dispatch.integrations.megatron import install
    from moe_dispatch.integrations.megatron.build import prepare_megatron, process_groups

    device = torch.device("cuda")
    prepare_megatron(device)
    pg = process_groups(dist.group.WORLD, dist.group.WORLD)
    x, dy = (t.to(device) for t in tokens(torch.bfloat16))
    out = {}
    for kind in KINDS:
        layer = install(_megatron(kind, torch.bfloat16, 1, pg), pg, fp8=FP8).to(device)
        rec = {"megatron": _megatron_step(layer, x, dy), "ours": _ours_step(layer, dist.group.WORLD, x, dy),
               "quantised_once": quantised_once(kind, torch.bfloat16, pg, x, dy)}
        layer.config.fp8_wgrad = False  # Megatron's --no-fp8-wgrad
        rec["megatron_wide_wgrad"] = _megatron_step(layer, x, dy)
        rec["ours_wide_wgrad"] = _ours_step(layer, dist.group.WORLD, x, dy)
        out[kind] = _to_cpu(rec)
    return out

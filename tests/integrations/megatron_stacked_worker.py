"""Spawned-rank code for test_megatron_stacked.py: install()'s stacked expert weights on one CPU
gloo rank (EP 1, megatron-core's MoELayer, SequentialMLP, no TE; the plug-in tests' shapes).

The reference is the row-stable path before the stacked weights (``stack_copy_forward``): every
forward stacked the transposed weights with torch.stack and autograd brought their gradients back
as transposed views.
"""
from __future__ import annotations

import io
import warnings

import torch
import torch.distributed as dist

from .megatron_worker import DTYPES, _build, _config, _pg, _setup, _step, _tokens

STEPS = 3  # Adam steps


def stack_copy_forward(activation: str):
    """The experts' forward of make_row_stable before the stacked weights (copies every step)."""
    from moe_dispatch.experts.activations import activate, scale_rows
    from moe_dispatch.experts.gemm import expert_gemm, select_gemm

    def forward(self, x, tokens_per_expert, permuted_probs):
        tokens_per_expert = torch.as_tensor(tokens_per_expert)
        w1 = torch.stack([e.linear_fc1.weight.t() for e in self.local_experts]).to(x.dtype)
        w2 = torch.stack([e.linear_fc2.weight.t() for e in self.local_experts]).to(x.dtype)
        h = expert_gemm(x, w1, tokens_per_expert, select_gemm(x, w1, True, True))
        act = activate(h, activation)
        if self._moe_dispatch_dispatcher.config.probs_in_experts:  # else the combine applies them
            act = scale_rows(act, permuted_probs)
        return expert_gemm(act, w2, tokens_per_expert, select_gemm(act, w2, True, True)), None
    return forward


def _use_stack_copy(layer) -> None:
    import types

    layer.experts.forward = types.MethodType(stack_copy_forward("gelu"), layer.experts)


def _stacked(layer) -> tuple:
    from moe_dispatch.integrations.megatron.experts import expert_weights, stacked_view

    return tuple(stacked_view(expert_weights(layer.experts, p)) is not None for p in ("linear_fc1", "linear_fc2"))


def _accumulated(layer, x, dy) -> dict:
    """Two forward + backward passes with the gradients accumulating into .grad."""
    _step(layer, x, dy)
    xi = x.reshape(-1, 2, x.shape[-1]).clone().requires_grad_()
    out, _ = layer(xi)
    out.backward(dy.reshape(out.shape))
    return {n: p.grad.clone() for n, p in layer.named_parameters()}


def _equivalence(pg, dtype) -> dict:
    """Fast path vs the stack-copy path vs the fallback copy (weights not views of one stack)."""
    x, dy = _tokens(dtype, "full")
    layer = _build(_config("alltoall", dtype, 1), pg, ours_from_spec=True, row_stable_gemms=True)
    fast_forward = layer.experts.forward
    rec = {"stacked": _stacked(layer), "fast": _step(layer, x, dy), "fast_acc": _accumulated(layer, x, dy)}
    _use_stack_copy(layer)
    rec["old"], rec["old_acc"] = _step(layer, x, dy), _accumulated(layer, x, dy)
    layer.experts.forward = fast_forward
    with torch.no_grad():  # every weight its own storage: the forward must copy them (and say so once)
        for e in layer.experts.local_experts:
            for lin in (e.linear_fc1, e.linear_fc2):
                lin.weight.data = lin.weight.data.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec["copied"] = _step(layer, x, dy)
        _step(layer, x, dy)
    rec["copy_warnings"] = sum("not views of one stacked storage" in str(w.message) for w in caught)
    rec["unstacked"] = _stacked(layer)
    layer.to(torch.float64).to(dtype)  # a conversion re-stacks
    rec["restacked"] = _stacked(layer)
    rec["after_restack"] = _step(layer, x, dy)
    return rec


def _parameters(pg) -> dict:
    """install() on a stock layer keeps its Parameter objects, names, shapes, dtypes."""
    from moe_dispatch.integrations.megatron import install

    layer = _build(_config("alltoall", torch.bfloat16, 1), pg, ours_from_spec=False)
    before = [(n, id(p), tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters()]
    attrs = {n: sorted(vars(p)) for n, p in layer.named_parameters()}
    install(layer, pg)
    after = [(n, id(p), tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters()]
    return {"before": before, "after": after, "stacked": _stacked(layer),
            "attrs": (attrs, {n: sorted(vars(p)) for n, p in layer.named_parameters()})}


def _sharded(layer, pg) -> dict:
    """key -> (key, global shape, global offset, data) of sharded_state_dict's ShardedTensors (the
    type name for other entries)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = {}
    for key, value in layer.sharded_state_dict(metadata={"dp_cp_group": pg.dp_cp}).items():
        if isinstance(value, ShardedTensor):
            out[key] = (value.key, tuple(value.global_shape), tuple(value.global_offset), value.data.clone())
        else:
            out[key] = (type(value).__name__,)
    return out


def _sd(layer) -> dict:
    """state_dict with its tensors cloned (Megatron's extra-state entries kept as they are)."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in layer.state_dict().items()}


def _state_dicts(pg, dtype) -> dict:
    """A stock checkpoint loads into the installed layer and back, bitwise."""
    stock = _build(_config("alltoall", dtype, 1), pg, ours_from_spec=False)
    ours = _build(_config("alltoall", dtype, 1), pg, ours_from_spec=True, row_stable_gemms=True)
    with torch.no_grad():  # make the two layers' weights differ before loading
        for p in ours.parameters():
            p.mul_(-0.5)
    buffer = io.BytesIO()
    torch.save(stock.state_dict(), buffer)
    buffer.seek(0)
    ours.load_state_dict(torch.load(buffer, weights_only=True))
    rec = {"stock_sd": _sd(stock), "ours_sd": _sd(ours), "stacked": _stacked(ours)}
    from moe_dispatch.integrations.megatron.experts import expert_weights, stacked_view

    # The stack itself holds the loaded weights (load_state_dict copied into the views).
    rec["stack_fc1"] = stacked_view(expert_weights(ours.experts, "linear_fc1")).clone()
    rec["stock_fc1"] = torch.stack([e.linear_fc1.weight.detach() for e in stock.experts.local_experts])
    x, dy = _tokens(dtype, "full")
    rec["ours_out"] = _step(ours, x, dy)
    _use_stack_copy(ours)
    rec["ours_old_out"] = _step(ours, x, dy)
    # And back: the installed layer's (changed) weights into a fresh stock layer.
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(1.0)
    back = _build(_config("alltoall", dtype, 1), pg, ours_from_spec=False)
    back.load_state_dict(ours.state_dict())
    rec["back_sd"], rec["ours_sd2"] = _sd(back), _sd(ours)
    rec["sharded"] = (_sharded(back, pg), _sharded(ours, pg))
    return rec


def _adam(pg, dtype) -> dict:
    """Adam built after install() trains the same parameters as on the stock layer, and the fast
    path trains them to the same bits as the stack-copy path."""
    x, dy = _tokens(dtype, "full")
    stock = _build(_config("alltoall", dtype, 1), pg, ours_from_spec=False)
    rec = {"stock_params": [(n, tuple(p.shape), p.dtype) for n, p in stock.named_parameters()]}
    for name in ("fast", "old"):
        layer = _build(_config("alltoall", dtype, 1), pg, ours_from_spec=True, row_stable_gemms=True)
        if name == "old":
            _use_stack_copy(layer)
        opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
        rec[f"{name}_params"] = [(n, tuple(p.shape), p.dtype) for n, p in layer.named_parameters()]
        rec[f"{name}_same_objects"] = [id(p) for g in opt.param_groups for p in g["params"]] == \
            [id(p) for p in layer.parameters()]
        outs = []
        for _ in range(STEPS):
            opt.zero_grad(set_to_none=True)
            outs.append(_step(layer, x, dy)["out"])
            opt.step()
        rec[name] = {"outs": outs, "params": {n: p.detach().clone() for n, p in layer.named_parameters()},
                     "stacked": _stacked(layer)}
    return rec


def _ddp(pg, dtype) -> dict:
    """Megatron's DistributedDataParallel around the installed layer: with its own param buffer
    (distributed optimizer: the weights move there, the experts copy them) and without."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    x, dy = _tokens(dtype, "full")
    plain = _build(_config("alltoall", dtype, 1), pg, ours_from_spec=True, row_stable_gemms=True)
    rec = {"plain": _step(plain, x, dy)}
    rec["plain_grads"] = {n: p.grad.clone() for n, p in plain.named_parameters()}
    for dist_opt in (False, True):
        cfg = _config("alltoall", dtype, 1)
        layer = _build(cfg, pg, ours_from_spec=True, row_stable_gemms=True)
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=dist_opt),
                                      layer, pg_collection=pg)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp.zero_grad_buffer()
            xi = x.reshape(-1, 2, x.shape[-1]).clone().requires_grad_()
            out, _ = ddp(xi)
            out.backward(dy.reshape(out.shape))
        rec[dist_opt] = {"out": out.detach().reshape(x.shape).clone(), "gx": xi.grad.reshape(x.shape).clone(),
                         "main_grads": {n.removeprefix("module."): p.main_grad.clone()
                                        for n, p in ddp.named_parameters()},
                         "stacked": _stacked(layer),
                         "warned": any("not views of one stacked storage" in str(w.message) for w in caught)}
    return rec


def stacked_worker(rank: int, world_size: int) -> dict:
    assert world_size == 1
    _setup()
    single = dist.new_group([0])
    pg = _pg(single, single)
    out = {"parameters": _parameters(pg)}
    for dname, dtype in DTYPES.items():
        out[dname] = {"equivalence": _equivalence(pg, dtype), "state_dicts": _state_dicts(pg, dtype),
                      "adam": _adam(pg, dtype), "ddp": _ddp(pg, dtype)}
    return out

"""Spawned-rank code for test_megatron_capture.py: install()'s sync-free dispatch at EP 1 inside
megatron-core's MoELayer (SequentialMLP, no TE), one rank alone.

- ``sync_free_worker`` (CPU, gloo, the test suite's CPU shims): the sync-free installed layer
  against the same layer on the dropless dispatcher, bitwise, and their host reads;
- ``capture_worker`` (CUDA): the installed layer's forward + backward captured with
  torch.cuda.graph and replayed on new tokens, against eager steps, bitwise; host syncs per step.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from moe_dispatch.config import DISPATCHER_KINDS
from tests.dispatcher.harness import value_error_of

from .megatron_worker import DTYPES, _build, _config, _pg, _setup, _step, _tokens

# The GPU test's shapes (bf16: the row-stable grouped expert GEMM, 16-byte row strides)
GPU_T, GPU_H, GPU_FFN, GPU_E, GPU_K = 512, 256, 256, 16, 4


def _note_counts(experts, args) -> None:
    """Forward pre-hook: whether tokens_per_expert is the handle's device counts (sync-free)."""
    _, tokens_per_expert, _ = args
    handle = experts._moe_dispatch_dispatcher.handle
    experts.device_counts = tokens_per_expert is handle.rows_per_expert


def sync_free_worker(rank: int, world_size: int) -> dict:
    assert world_size == 1
    _setup()
    from moe_dispatch.integrations.megatron import install
    from tests.cuda_host_waits import count_host_transfers, count_scalar_copies

    pg1 = _pg(dist.group.WORLD, dist.group.WORLD)
    records = {}
    for dname, dtype in DTYPES.items():
        x, dy = _tokens(dtype, "full")
        for kind in DISPATCHER_KINDS:
            rec = {}
            layer = install(_build(_config(kind, dtype, 1), pg1, ours_from_spec=False), pg1, sync_free=True)
            twin = install(_build(_config(kind, dtype, 1), pg1, ours_from_spec=False), pg1)  # default: dropless
            rec["sync_free"] = (layer.token_dispatcher.config.sync_free, twin.token_dispatcher.config.sync_free)
            for module in (layer, twin):
                module.experts.register_forward_pre_hook(_note_counts)
            with count_host_transfers() as counts, count_scalar_copies() as scalar_copies:
                rec["ours"] = _step(layer, x, dy)
            rec["ours_reads"] = dict(counts, scalar_copies=len(scalar_copies))
            with count_host_transfers() as counts:
                rec["dropless"] = _step(twin, x, dy)
            rec["dropless_reads"] = dict(counts)
            rec["device_counts"] = (layer.experts.device_counts, twin.experts.device_counts)
            rec["ours_again"] = _step(layer, x[:64], dy[:64])  # another T: nothing kept from the first
            rec["dropless_again"] = _step(twin, x[:64], dy[:64])
            records[(dname, kind)] = rec
    # row_stable_gemms=False keeps Megatron's experts, which need the host counts: dropless
    plain = install(_build(_config("alltoall", torch.float32, 1), pg1, ours_from_spec=False), pg1,
                    row_stable_gemms=False)
    records["plain_sync_free"] = plain.token_dispatcher.config.sync_free
    unfit = _build(_config("alltoall", torch.float32, 1), pg1, ours_from_spec=False)
    records["refused"] = value_error_of(lambda: install(unfit, pg1, row_stable_gemms=False, sync_free=True))
    return records


def _grads(layer, x: torch.Tensor) -> list:
    """[x.grad] + every parameter's .grad (the live tensors: a replay rewrites the graph's own)."""
    return [x.grad] + [p.grad for _, p in layer.named_parameters()]


def _eager(layer, x: torch.Tensor, dy: torch.Tensor) -> list:
    """(output, x's gradient, every parameter's gradient) of one forward + backward on x."""
    layer.zero_grad(set_to_none=True)
    xi = x.detach().clone().requires_grad_()
    out, bias = layer(xi)
    assert bias is None
    out.backward(dy)
    return [out.detach().clone()] + [g.clone() for g in _grads(layer, xi)]


def _compare(names: list, got: list, expected: list) -> list:
    """(name, bitwise equal, max |difference|) per tensor."""
    rows = []
    for name, a, b in zip(names, got, expected):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else float("inf")
        rows.append((name, same, diff))
    return rows


def capture_worker(rank: int, world_size: int) -> dict:
    """Per dispatcher kind: the installed layer at EP 1 (bf16, aux loss on) captured, replays on new
    tokens against eager steps, the sync-free eager step against the dropless one, host waits."""
    assert world_size == 1
    warnings.filterwarnings("ignore")  # Megatron's import-time notices (no TE, no apex, ...)
    from moe_dispatch.integrations.megatron import install
    from moe_dispatch.integrations.megatron.build import (
        build_moe_layer,
        load_seeded_weights,
        moe_transformer_config,
        prepare_megatron,
        process_groups,
    )
    from moe_dispatch.ops import check_device_errors
    from moe_dispatch.tools.capture import capture_step
    from moe_dispatch.tools.profiling import host_waits

    device = torch.device("cuda")
    prepare_megatron(device)
    pg = process_groups(dist.group.WORLD, dist.group.WORLD)
    T, H, FFN, E, K = GPU_T, GPU_H, GPU_FFN, GPU_E, GPU_K
    out: dict = {}
    for kind in DISPATCHER_KINDS:
        def build():
            config = moe_transformer_config(H, FFN, E, K, kind, torch.bfloat16, 1, router_dtype="fp32",
                                            moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2)
            layer = load_seeded_weights(build_moe_layer(config, pg, ours=False), init_seed=1234)
            return install(layer, pg, sync_free=True).to(device)
        layer, twin = build(), build()
        rec: dict = {"sync_free": layer.token_dispatcher.config.sync_free}
        names = ["output", "x.grad"] + [f"{n}.grad" for n, _ in layer.named_parameters()]
        gen = torch.Generator(device=device).manual_seed(5)
        dy = torch.randn((T, 1, H), generator=gen, device=device, dtype=torch.bfloat16)
        x = torch.randn((T, 1, H), generator=gen, device=device, dtype=torch.bfloat16, requires_grad=True)

        def step() -> torch.Tensor:
            out, _ = layer(x)
            out.backward(dy)
            return out

        graph, static_out = capture_step(layer, x, step)
        static_grads = _grads(layer, x)
        rec["replays"] = []
        for _ in range(2):  # new tokens copied into the static input, then replay
            fresh = torch.randn((T, 1, H), generator=gen, device=device, dtype=torch.bfloat16)
            with torch.no_grad():
                x.copy_(fresh)
            graph.replay()
            replayed = [static_out.detach().clone()] + [g.clone() for g in static_grads]
            rec["replays"].append(_compare(names, replayed, _eager(layer, fresh, dy)))
        check_device_errors()

        # The sync-free eager step against the dropless dispatcher's, same weights and tokens.
        from moe_dispatch.integrations.megatron import dispatcher_from_megatron

        dropless = dispatcher_from_megatron(twin.config, pg, probs_in_experts=False)
        twin.token_dispatcher = twin.experts._moe_dispatch_dispatcher = dropless
        rec["vs_dropless"] = _compare(names, _eager(layer, fresh, dy), _eager(twin, fresh, dy))

        xh = fresh.detach().clone().requires_grad_()

        def step(layer=layer, xh=xh):
            layer.zero_grad(set_to_none=True)
            xh.grad = None
            layer(xh)[0].backward(dy)
        rec["host_waits"] = host_waits(step)
        rec["dropless_host_waits"] = host_waits(lambda: twin(fresh.detach().clone().requires_grad_())[0].backward(dy))
        out[kind] = rec
    return out

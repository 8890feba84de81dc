"""Expert-parallel benchmarks on several GPUs: dispatch + combine round trip and MoELayer
forward + backward, ours beside megatron-core's in the same run.

    torchrun --nproc-per-node 2 scripts/bench_ep.py [--what dispatch,layer] [--tokens 8192]
    torchrun --nproc-per-node 2 -m tests.bench_ep_cpu   # --cpu-smoke: gloo, tiny: checks the script runs
    torchrun --nproc-per-node 1 scripts/bench_ep.py --what layer   # the EP-1 layer on one GPU
    torchrun --nproc-per-node 1 scripts/bench_ep.py --what ep1,profile-layer --ep1-layers ours,installed
        # EP 1 only: ours (eager dropless, eager sync-free, and the sync-free step captured in a
        # CUDA graph) beside Megatron after install(), grads reset and accumulating, and profiles

Round trip: identity experts; ours (alltoall, allgather), Megatron's MoEAlltoAll/MoEAllGather
token dispatchers, and a raw all_to_all_single of the K-copy rows there and back. The byte floor
is the bytes this rank must send to other ranks (deduplicated tokens on dispatch, K-copy rows on
combine) over the all-to-all bandwidth measured here (the raw exchange).
Layer: hidden 4096, ffn 1024, 64 experts, top-6, bf16, fp32 router; Megatron's MoELayer with
SequentialMLP and no TransformerEngine (what a user without TE gets). First the EP-1 layers (each
rank alone: ours, Megatron after install(), stock Megatron; ``--ep1-layers``) with gradients reset
every step beside gradients accumulating, with the host synchronisations and host<->device copies
per step (torch.profiler). ``profile-layer``: torch.profiler top-kernels tables of those layers.
Times are medians of CUDA-event timings on rank 0 over a fixed number of iterations that every
rank runs: triton.testing.do_bench sizes its loop from a per-rank estimate, and ranks that loop a
different number of times over collectives hang.
"""
from __future__ import annotations

import argparse
import os
import traceback

import torch
import torch.distributed as dist
import triton
from bench_ops import time_host_calls  # python puts this script's folder first on its path

from moe_dispatch import MoEConfig, MoELayer
from moe_dispatch.config import DISPATCHER_KINDS
from moe_dispatch.dispatcher import build_dispatcher
from moe_dispatch.tools import profiling
from moe_dispatch.tools.benchmarks import routing
from moe_dispatch.tools.capture import capture_step

DEVICE = torch.device("cuda")
WARMUP, ITERS = 5, 30  # --cpu-smoke: 1, 2 (the smoke run checks that the script runs, not times)


def bench(fn, warmup: int = 0, iters: int = 0) -> float:
    """Median ms of fn over `iters` (default ITERS) timed calls after `warmup` (default WARMUP)
    (CUDA events; host clock on CPU); the same count on every rank."""
    return profiling.median_ms(fn, iters or ITERS, warmup or WARMUP, DEVICE, before=dist.barrier)


def say(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def our_round_trip(args, kind: str, x: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
    """dispatch + combine with identity experts through our `kind` dispatcher over every rank."""
    config = MoEConfig(hidden_size=args.hidden, num_experts=args.experts, topk=args.topk,
                       ffn_hidden_size=args.ffn, dispatcher=kind)
    dispatcher = build_dispatcher(config, dist.group.WORLD)

    def round_trip():
        expert_input, _, handle = dispatcher.dispatch(x, routing_map, probs)
        return dispatcher.combine(expert_input, handle)
    return round_trip


_PG = None


def megatron_groups(world: int, rank: int):
    """Megatron's process groups for one MoE layer: EP over every rank, everything else alone."""
    global _PG
    if _PG is None:
        from moe_dispatch.integrations.megatron.build import prepare_megatron, process_groups
        # On CPU (--cpu-smoke) only where the test suite's launcher applied its CPU shims.
        prepare_megatron(DEVICE)
        single = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
        _PG = process_groups(dist.group.WORLD, single)
    return _PG


def megatron_config(H: int, E: int, K: int, ffn: int, world: int, kind: str, **extra):
    from moe_dispatch.integrations.megatron.build import moe_transformer_config
    # CPU initialisation: GPU initialisation needs Megatron's model-parallel RNG tracker.
    return moe_transformer_config(H, ffn, E, K, kind, torch.bfloat16, ep_size=world, router_dtype="fp32", **extra)


# The Megatron EP-1 layers of --ep1-layers; "-te": TransformerEngine's spec with --moe-grouped-gemm
# (TEGroupedMLP experts) and --moe-permute-fusion, as production Megatron runs.
MEGATRON_EP1_LAYERS = {
    "installed": "Megatron alltoall after install() (row-stable GEMMs, stacked expert weights)",
    "installed-sync-free": "Megatron alltoall after install(sync_free=True)",
    "installed-te": "Megatron + TE (TEGroupedMLP) alltoall after install()",
    "stock-te": "Megatron + TE alltoall stock, TEGroupedMLP, fused permute",
    "stock": "Megatron alltoall stock, SequentialMLP, no TE",
}


def bench_dispatch(args, world: int, rank: int) -> None:
    if world < 2:
        say("# the round trip needs at least 2 ranks (its floor is the bytes sent to other ranks); skipped")
        return
    T, E, K, H = args.tokens, args.experts, args.topk, args.hidden
    x = torch.randn((T, H), device=DEVICE, dtype=torch.bfloat16)
    routing_map, probs = routing(T, E, K, seed=rank, device=DEVICE)
    El = E // world
    # Bytes this rank must send to other ranks: each token once per remote rank holding one of
    # its experts (dispatch), each (token, remote expert) row back (combine).
    owner = torch.arange(E, device=DEVICE) // El
    remote = owner != rank
    dedup_rows = int(torch.stack([routing_map[:, owner == r].any(1) for r in range(world) if r != rank]).sum())
    combine_rows = int(routing_map[:, remote].sum())
    floor_bytes = (dedup_rows + combine_rows) * H * 2 + dedup_rows * El * 4
    # Raw exchange of the K-copy rows (equal splits), there and back.
    kcopy = torch.randn((T * K, H), device=DEVICE, dtype=torch.bfloat16)
    recv = torch.empty_like(kcopy)

    def raw_round_trip():
        dist.all_to_all_single(recv, kcopy)
        dist.all_to_all_single(kcopy, recv)
    raw_ms = bench(raw_round_trip)
    raw_remote_bytes = 2 * T * K * H * 2 * (world - 1) / world
    bw = raw_remote_bytes / (raw_ms * 1e-3)
    floor_ms = floor_bytes / bw * 1e3
    rows = [("raw all_to_all_single, K-copy rows, there and back", raw_ms)]
    # The floor's own traffic through NCCL, nothing sent to self: deduplicated tokens there, K-copy
    # rows back (equal splits of this rank's counts; what a transport without local copies moves).
    counts = torch.tensor([dedup_rows, combine_rows], device=DEVICE)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)  # one size on every rank: splits must match pairwise
    peers = max(world - 1, 1)
    per_peer = [int(counts[0]) // peers if r != rank else 0 for r in range(world)]
    per_peer_back = [int(counts[1]) // peers if r != rank else 0 for r in range(world)]
    send_x = torch.randn((sum(per_peer), H), device=DEVICE, dtype=torch.bfloat16)
    recv_x = torch.empty_like(send_x)
    send_back = torch.randn((sum(per_peer_back), H), device=DEVICE, dtype=torch.bfloat16)
    recv_back = torch.empty_like(send_back)

    def remote_only_round_trip():
        dist.all_to_all_single(recv_x, send_x, per_peer, per_peer)
        dist.all_to_all_single(recv_back, send_back, per_peer_back, per_peer_back)
    rows.append(("raw all_to_all_single, floor traffic only (dedup there, K-copy back, no self chunk)",
                 bench(remote_only_round_trip)))

    for kind in DISPATCHER_KINDS:
        say(f"# measuring ours {kind} round trip ...")
        rows.append((f"ours {kind} round trip", bench(our_round_trip(args, kind, x, routing_map, probs))))
    try:
        pg = megatron_groups(world, rank)
        from megatron.core.transformer.moe.token_dispatcher import (
            MoEAllGatherTokenDispatcher,
            MoEAlltoAllTokenDispatcher,
        )
        for kind, cls in [("alltoall", MoEAlltoAllTokenDispatcher), ("allgather", MoEAllGatherTokenDispatcher)]:
            cfg = megatron_config(H, E, K, args.ffn, world, kind)
            d = cls(El, list(range(rank * El, (rank + 1) * El)), cfg, pg_collection=pg)

            def theirs():
                h, p = d.dispatch_preprocess(x, routing_map, probs)
                h, p = d.token_dispatch(h, p)
                h, _, p = d.dispatch_postprocess(h, p)
                h = d.combine_preprocess(h)
                h = d.token_combine(h)
                return d.combine_postprocess(h)
            say(f"# measuring Megatron {kind} round trip ...")
            rows.append((f"Megatron {kind} round trip", bench(theirs)))
    except Exception:
        say("# Megatron dispatchers failed:\n" + traceback.format_exc())
    say(f"\n## Dispatch + combine round trip, identity experts: {world} ranks, {T} tokens/rank, H={H}, E={E}, "
        f"K={K}, bf16, fp32 probs")
    say(f"# all-to-all bus bandwidth measured by the raw exchange: {bw / 1e9:.0f} GB/s; byte floor of a "
        f"deduplicated dispatch + K-copy combine on rank 0: {floor_ms:.3f} ms")
    say("| what | time (ms) | / floor |\n|---|---|---|")
    for name, ms in rows:
        say(f"| {name} | {ms:.3f} | {ms / floor_ms:.2f}x |")


def bench_layer(args, world: int, rank: int) -> None:
    T, E, K, H, F = args.tokens, args.experts, args.topk, args.hidden, args.ffn
    x = torch.randn((T, H), device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn((T, H), device=DEVICE, dtype=torch.bfloat16)
    rows = []
    for kind in DISPATCHER_KINDS:
        for impl, stable in [("grouped", True), ("grouped", False), ("sequential", True)]:
            config = MoEConfig(hidden_size=H, num_experts=E, topk=K, ffn_hidden_size=F, dispatcher=kind,
                               expert_impl=impl, params_dtype=torch.bfloat16, load_balancing_type="none")
            layer = MoELayer(config, dist.group.WORLD, layer_index=0).to(DEVICE)
            if not stable:
                if not hasattr(layer.experts, "row_stable"):
                    continue
                layer.experts.row_stable = False
            label = f"ours {kind}, {impl} experts{'' if stable else ' (not row-stable)'}"

            def fwd_bwd():
                layer(x).backward(g)
            with torch.no_grad():
                fwd = bench(lambda: layer(x))
            say(f"# measuring {label} ...")
            rows.append((label, bench(fwd_bwd), fwd))
    try:
        pg = megatron_groups(world, rank)
        from moe_dispatch.integrations.megatron.build import build_moe_layer
        variants = [("", False, False), (", our dispatcher installed", True, False),
                    (", our dispatcher + row-stable GEMMs (install default)", True, True)]
        for kind in DISPATCHER_KINDS:
            for suffix, ours, row_stable in variants:
                cfg = megatron_config(H, E, K, F, world, kind)
                layer = build_moe_layer(cfg, pg, ours=ours, device=DEVICE, row_stable_gemms=row_stable)
                xm = x.detach().view(T, 1, H).clone().requires_grad_()
                gm = g.view(T, 1, H)

                def fwd_bwd():
                    out, _ = layer(xm)
                    out.backward(gm)
                with torch.no_grad():
                    fwd = bench(lambda: layer(xm))
                label = f"Megatron {kind}, SequentialMLP, no TE{suffix}"
                say(f"# measuring {label} ...")
                rows.append((label, bench(fwd_bwd), fwd))
    except Exception:
        say("# Megatron MoELayer failed:\n" + traceback.format_exc())
    flops = 2 * 3 * T * K * H * F * 2  # fc1 + fc2, forward + 2x backward
    say(f"\n## MoELayer forward + backward: {world} ranks, {T} tokens/rank, H={H}, ffn={F}, E={E}, K={K}, bf16")
    say(f"# expert GEMM work: {flops / 1e12:.2f} TFLOP per rank per step")
    say("| layer | fwd+bwd (ms) | fwd (ms) | tokens/s per rank (fwd+bwd) |\n|---|---|---|---|")
    for name, ms, fwd in rows:
        say(f"| {name} | {ms:.2f} | {fwd:.2f} | {T / (ms * 1e-3):,.0f} |")


def host_waits(fn, steps: int = 3) -> str:
    """'syncs / copies' per call of fn: synchronisations torch makes the host wait for, and
    host<->device copies (moe_dispatch.tools.profiling.host_waits); 'n/a' on the CPU."""
    if DEVICE.type != "cuda":
        return "n/a"
    counts = profiling.host_waits(fn, steps, warmup=1)
    return f"{counts['syncs']:g} / {counts['copies']:g}"


def _ep1_layers(args, single, world: int, rank: int, which: str):
    """(label, layer, x, forward + backward) of the EP-1 layers named in ``which`` ('ours': the
    layer's default sync-free step and the dropless dispatcher, 'installed': Megatron after
    install(), 'installed-sync-free': after install(sync_free=True), 'stock': Megatron's own;
    'stock-te' / 'installed-te': Megatron + TransformerEngine, TEGroupedMLP, fused permute), each
    rank alone."""
    from moe_dispatch.dispatcher import AllToAllDispatcher

    T, E, K, H, F = args.tokens, args.experts, args.topk, args.hidden, args.ffn
    x = torch.randn((T, H), device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn((T, H), device=DEVICE, dtype=torch.bfloat16)
    out = []
    if "ours" in which:
        config = MoEConfig(hidden_size=H, num_experts=E, topk=K, ffn_hidden_size=F, params_dtype=torch.bfloat16,
                           load_balancing_type="none")
        ours_layer = MoELayer(config, single, layer_index=0).to(DEVICE)
        dropless = MoELayer(config, single, layer_index=0).to(DEVICE)
        dropless.dispatcher = AllToAllDispatcher(config, single)  # sizes read on the host once per step
        out.append(("ours alltoall, grouped row-stable experts, sync-free", ours_layer, x,
                    lambda: ours_layer(x).backward(g)))
        out.append(("ours alltoall, grouped row-stable experts, dropless", dropless, x,
                    lambda: dropless(x).backward(g)))
    megatron = [name for name in MEGATRON_EP1_LAYERS if name in which.split(",")]
    if megatron:
        from moe_dispatch.integrations.megatron import install
        from moe_dispatch.integrations.megatron.build import build_moe_layer, process_groups
        megatron_groups(world, rank)  # Megatron's set-up (and the CPU shims on --cpu-smoke)
        pg = process_groups(single, single)
        xm = x.detach().view(T, 1, H).clone().requires_grad_()
        gm = g.view(T, 1, H)
        for name in megatron:
            te = name.endswith("-te")
            # TE: what production Megatron runs (--moe-grouped-gemm --moe-permute-fusion).
            extra = dict(moe_grouped_gemm=True, moe_permute_fusion=True) if te else {}
            config = megatron_config(H, E, K, F, 1, "alltoall", **extra)
            layer = build_moe_layer(config, pg, ours=name in ("installed", "installed-sync-free"), device=DEVICE,
                                    use_te=te)
            if name == "installed-sync-free":
                install(layer, pg, sync_free=True)  # again: idempotent, now with the sync-free dispatch
            if name == "installed-te":
                install(layer, pg)  # on the layer Megatron built: its own TEGroupedMLP parameters
            label = MEGATRON_EP1_LAYERS[name]

            def fwd_bwd(layer=layer):
                layer(xm)[0].backward(gm)
            out.append((label, layer, xm, fwd_bwd))
    return out


def _sync_free(layer) -> bool:
    """Our MoELayer or Megatron's after install(), running the sync-free dispatch."""
    if isinstance(layer, MoELayer):
        return layer.dispatcher.sync_free
    from moe_dispatch.integrations.megatron import is_installed
    return is_installed(layer) and layer.token_dispatcher.config.sync_free


def bench_layer_ep1(args, single, world: int, rank: int) -> None:
    """The EP-1 layers (each rank alone, group ``single``): ours (sync-free, dropless), Megatron
    after install() and stock Megatron (``--ep1-layers``), forward + backward with the gradients
    reset every step beside gradients accumulating into .grad; on CUDA also ours sync-free
    captured in a CUDA graph (gradients reset each step)."""
    T, E, K, H, F = args.tokens, args.experts, args.topk, args.hidden, args.ffn
    rows = []
    for label, layer, x, fwd_bwd in _ep1_layers(args, single, world, rank, args.ep1_layers):
        def reset(layer=layer, x=x, fwd_bwd=fwd_bwd):
            layer.zero_grad(set_to_none=True)
            x.grad = None
            fwd_bwd()

        def accumulate(fwd_bwd=fwd_bwd):
            fwd_bwd()
        rows.append((label, "grads reset each step", bench(reset), host_waits(reset)))
        rows.append((label, "grads accumulating into .grad", bench(accumulate), host_waits(accumulate)))
        if _sync_free(layer):
            if DEVICE.type == "cuda":
                replay = capture_step(layer, x, fwd_bwd)[0].replay  # grads reset each replay
                rows.append((label, "captured (CUDA graph), grads reset each step", bench(replay),
                             host_waits(replay)))
            else:
                say("# captured (CUDA graph) row: skipped, CUDA only")
        del layer
    flops = 2 * 3 * T * K * H * F * 2
    say(f"\n## EP-1 MoELayer forward + backward: {T} tokens, H={H}, ffn={F}, E={E}, K={K}, bf16, fp32 router; "
        f"expert GEMM work {flops / 1e12:.2f} TFLOP")
    say("# A training step that calls optimizer.zero_grad(set_to_none=True) (PyTorch's default) pays 'grads reset "
        "each step': its backward writes .grad. 'Accumulating' is what micro-batches after the first pay under "
        "gradient accumulation (one extra read-add-write of every weight gradient).")
    say("| EP-1 layer | step | fwd+bwd (ms) | host syncs / host<->device copies per step |\n|---|---|---|---|")
    for label, name, ms, waits in rows:
        say(f"| EP-1 {label} | {name} | {ms:.2f} | {waits} |")


_PHASES = {"router": ("forward",), "experts": ("forward",),
           "dispatcher": ("dispatch_rows", "combine"),  # ours (MoELayer calls dispatch_rows)
           "token_dispatcher": ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess",
                                "combine_preprocess", "token_combine", "combine_postprocess")}  # Megatron's


def label_phases(layer) -> None:
    """Wrap the layer's router, experts and dispatcher calls in record_function ranges named after
    them, so that ``profiling.gpu_idle`` can say in which part of the step the GPU waited."""
    from torch.profiler import record_function

    for part, methods in _PHASES.items():
        owner = getattr(layer, part, None)
        for method in methods if owner is not None else ():
            original = getattr(owner, method)

            def wrapped(*a, _fn=original, _name=f"{part}.{method}", **k):
                with record_function(_name):
                    return _fn(*a, **k)
            setattr(owner, method, wrapped)


def profile_layer_ep1(args, single, world: int, rank: int) -> None:
    """torch.profiler tables (rank 0) of the EP-1 layers named by ``--ep1-layers``, forward +
    backward x5, gradients reset and accumulating: the top kernels, the ops with their input
    shapes, and the GPU's idle time by the part of the step the host was in when it launched the
    next kernel (``profiling.gpu_idle``); not a benchmark."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = DEVICE.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    steps = 5 if cuda else 1
    for label, layer, x, fwd_bwd in _ep1_layers(args, single, world, rank, args.ep1_layers):
        label_phases(layer)
        for mode in ("reset", "accumulating"):
            def step(layer=layer, x=x, fwd_bwd=fwd_bwd, mode=mode):
                if mode == "reset":
                    layer.zero_grad(set_to_none=True)
                    x.grad = None
                with record_function("step"):
                    fwd_bwd()
            for _ in range(WARMUP):
                step()
            if cuda:
                torch.cuda.synchronize()
            with profile(activities=activities, record_shapes=True) as prof:
                for _ in range(steps):
                    step()
                if cuda:
                    torch.cuda.synchronize()
            say(f"\n## profile: EP-1 {label}, grads {mode}, fwd+bwd x{steps}, rank 0 (sorted by {sort})")
            averages = prof.key_averages()
            say(averages.table(sort_by=sort, row_limit=args.profile_rows, max_name_column_width=70))
            say(f"\n### the same, ops by input shape (top {args.profile_rows})")
            by_shape = prof.key_averages(group_by_input_shape=True)
            say(by_shape.table(sort_by=sort, row_limit=args.profile_rows, max_name_column_width=40,
                               max_shapes_column_width=60))
            if cuda:
                idle = profiling.gpu_idle(prof.events(), steps)
                say(f"\n### GPU idle per step: {idle['idle_us'] / 1e3:.2f} ms idle, {idle['busy_us'] / 1e3:.2f} ms "
                    "busy (first kernel to last); where the host was when it launched the kernel after each gap")
                say("| host phase / launching op | GPU idle (us per step) | gaps per step |\n|---|---|---|")
                for key, us, count in idle["rows"][:args.profile_rows]:
                    say(f"| {key} | {us:.1f} | {count:.1f} |")


def profile_dispatch(args, world: int, rank: int) -> None:
    """Where a round trip's time goes: torch.profiler tables (rank 0) with one range per stage, and
    the host cost of each op at a tiny size (launch-bound), for tuning; not a benchmark."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from moe_dispatch.dispatcher import functional
    from moe_dispatch.ops import kernels, permutation

    # functional.dispatch / combine call the stages by these names (dispatcher/stages.py)
    for name in ["prepare", "send_just_prepared", "finish", "check_expert_output", "return_rows", "owner_sum"]:
        fn = getattr(functional, name)

        def wrapped(*a, _fn=fn, _name=name, **k):
            with record_function(f"stage::{_name}"):
                return _fn(*a, **k)
        setattr(functional, name, wrapped)
    T, E, K, H = args.tokens, args.experts, args.topk, args.hidden
    x = torch.randn((T, H), device=DEVICE, dtype=torch.bfloat16)
    routing_map, probs = routing(T, E, K, seed=rank, device=DEVICE)
    for kind in DISPATCHER_KINDS:
        ours = our_round_trip(args, kind, x, routing_map, probs)
        for _ in range(5):
            ours()
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                ours()
            torch.cuda.synchronize()
        say(f"\n## profile: {kind} round trip x5, rank 0")
        say(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
        say(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    # Host cost per call at a tiny size (the GPU work is negligible: the loop is launch-bound).
    t, e, h = 64, 8, 128
    xs = torch.randn((t, h), device=DEVICE, dtype=torch.bfloat16)
    rm, pr = routing(t, e, 2, seed=0, device=DEVICE)
    _, _, rid = permutation.permute(xs, rm, pr)
    rows = torch.randn((rid.num_out_tokens, h), device=DEVICE, dtype=torch.bfloat16)
    slots = rid.slots
    cases = {
        "torch add_ (baseline)": lambda: xs.add_(0),
        "make_slots op": lambda: torch.ops.moe_dispatch.make_slots(rm, 1),
        "permute_rows op": lambda: torch.ops.moe_dispatch.permute_rows(xs, slots, pr, rid.num_out_tokens, False),
        "triton permute_rows direct": lambda: kernels.permute_rows(xs, slots, pr, rid.num_out_tokens, False),
        "permute (public, syncs)": lambda: permutation.permute(xs, rm, pr),
        "permute (public, host counts)": lambda: permutation.permute(xs, rm, pr, tokens_per_expert=rm.sum(0).tolist()),
        "unpermute (public)": lambda: permutation.unpermute(rows, rid, pr),
        "sort_chunks": lambda: permutation.sort_chunks(rows, [rows.shape[0] // 2, rows.shape[0] - rows.shape[0] // 2],
                                                       [1, 0]),
    }
    say("\n## host cost per call, tiny size (us)\n| op | us/call |\n|---|---|")
    for name, us in time_host_calls(cases):
        say(f"| {name} | {us:.1f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--what", default="dispatch,layer")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=6)
    parser.add_argument("--ep1-layers", default="ours,installed,stock",
                        help="EP-1 layers for the 'ep1' and 'profile-layer' parts: ours, installed, "
                             "installed-sync-free (install(sync_free=True)), stock; with TransformerEngine "
                             "also stock-te (TEGroupedMLP, fused permute) and installed-te (install() on it)")
    parser.add_argument("--profile-rows", type=int, default=25, help="rows of each profile table")
    parser.add_argument("--cpu-smoke", action="store_true", help="gloo on CPU at a tiny size: does the script run?")
    args = parser.parse_args(argv)
    global DEVICE, WARMUP, ITERS
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.cpu_smoke:
        DEVICE = torch.device("cpu")
        WARMUP, ITERS = 1, 2
        args.tokens, args.hidden, args.ffn, args.experts, args.topk = 64, 64, 32, 8, 2
        dist.init_process_group("gloo")
        name = "CPU (smoke run; times mean nothing)"
    else:
        torch.cuda.set_device(local_rank)
        DEVICE = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=DEVICE)
        name = torch.cuda.get_device_name()
    world, rank = dist.get_world_size(), dist.get_rank()
    say(f"# {name} x{world}, torch {torch.__version__}, triton {triton.__version__}")
    parts = args.what.split(",")
    unknown = set(parts) - {"profile", "dispatch", "layer", "ep1", "profile-layer"}
    if unknown:
        raise SystemExit(f"--what: unknown parts {sorted(unknown)}; expected profile, dispatch, layer, ep1, "
                         "profile-layer")
    single = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    if "profile" in parts:
        profile_dispatch(args, world, rank)
    if "dispatch" in parts:
        bench_dispatch(args, world, rank)
    if "layer" in parts or "ep1" in parts:
        bench_layer_ep1(args, single, world, rank)
    if "layer" in parts:
        bench_layer(args, world, rank)
    if "profile-layer" in parts:
        profile_layer_ep1(args, single, world, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

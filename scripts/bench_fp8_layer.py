"""The FP8 layer (``MoEConfig(fp8="e4m3")``) beside bf16 in one run, on one GPU (EP 1).

    python scripts/bench_fp8_layer.py [--tokens 8192 --hidden 4096 --ffn 1024 --experts 64 --topk 6]

Prints three tables:
1. The layer's forward + backward, bf16 and FP8 (median ms of CUDA-event timings), eager and
   captured in a CUDA graph (``moe_dispatch.tools.capture.capture_step``, gradients reset each
   replay; the replay checked bitwise against the eager step), with the bitwise checks beside it:
   both dispatchers give the same output and input gradient, and so do 64 of its tokens alone.
   Then FP8 with the expert weights quantised once (``layer.quantize_fp8_weights()``, as once per
   optimizer step for its micro-batches), its output and input gradient checked bitwise against
   the per-call FP8 step's, and the time of that quantisation alone. Then both again with wgrad's
   other accumulation (``experts.fp8.FAST_ACCUM_WGRAD`` flipped: fp32-promoted, the default being
   fast), with the same checks and the expert weight gradients' relative change. Then FP8 with
   ``fp8_wgrad=False`` (the expert weight gradients in bf16), with the same checks, its expert weight
   gradients bitwise across the dispatchers, and their distance from the bf16 layer's against FP8
   wgrad's. ``--no-routes`` skips the LAUNCH routes' rows.
2. The row quantisation (``ops.quantize_rows``) of the layer's tokens against its byte floor: each
   input read once and each output written once, over the device-to-device copy bandwidth
   measured in the same run (the kernels and the copy timed as CUDA-graph replays,
   ``graph_median_ms``: a kernel's time without its launcher's host time, as in a captured step),
   ``ops.dequantize_rows`` (fp8_wgrad=False's widening of the saved rows) against its floor, and a
   sweep of quantize_rows' LAUNCH settings (each result checked bitwise against the default's).
   Then the weight gradient's per-(expert, column) quantisation (``ops.quantize_group_columns``,
   one kernel) of the layer step's four wgrad operands (the saved float8 inputs dequantised by their
   row scales inside the kernel, and the bf16 output gradients), rows split over the experts at random and
   with one expert holding half of them, with 1, 4 and 8 slices per expert and the tiled route, against its byte
   floor (x read once, qt and the scales written once), and a sweep of its LAUNCH settings (none
   changes a value). ``--no-sweeps`` skips both sweeps; ``--kernels-only`` prints table 2 alone.
   Then every quantisation of one FP8 step at its byte floor (``--floor-only TB_PER_S`` prints
   only this table, from the shapes, without a GPU).
3. Where the step's time goes (bf16, FP8 per call, FP8 with the weights quantised once):
   torch.profiler's CUDA time per kernel, by category (the GEMMs, zero fills, quantisation,
   permute/combine, the rest), so the non-GEMM time is itemised, then the operators that launched
   the most GPU time, with their input shapes.
Both layers run the EP-1 sync-free dispatch (no host read), so both capture.
"""
from __future__ import annotations

import argparse
import re

import torch
from torch.profiler import ProfilerActivity, profile

from moe_dispatch import MoEConfig, MoELayer
from moe_dispatch.numerics.rounding import round_up
from moe_dispatch.ops import dequantize_rows, quantize_group_columns, quantize_rows
from moe_dispatch.ops import kernels as KT
from moe_dispatch.tools.benchmarks import add_shape_args, layer_inputs, layer_step
from moe_dispatch.tools.capture import capture_step
from moe_dispatch.tools.profiling import graph_median_ms, median_ms

DEVICE = torch.device("cuda")
LAYER_TABLE_HEADER = ("| layer | eager ms | captured ms | replay bitwise eager | bitwise across dispatchers "
                      "| 64 tokens alone bitwise | median rel. error vs bf16 |\n|---|---|---|---|---|---|---|")


def captured(config: MoEConfig, x: torch.Tensor, upstream: torch.Tensor, eager: tuple,
             once: bool = False) -> tuple[float, bool]:
    """(median ms of a CUDA-graph replay of the layer's forward + backward, whether the replay's
    output and input gradient are bitwise ``eager``'s: the same config builds the same weights).
    ``once``: the FP8 weights quantised before the capture, outside the graph."""
    layer = MoELayer(config, layer_index=0).to(DEVICE)
    xs = x.detach().clone().requires_grad_()
    weights = layer.quantize_fp8_weights() if once else None

    def fwd_bwd() -> torch.Tensor:
        out = layer(xs, fp8_weights=weights)
        out.backward(upstream)
        return out
    graph, out = capture_step(layer, xs, fwd_bwd)
    graph.replay()
    torch.cuda.synchronize()
    same = torch.equal(out, eager[0]) and torch.equal(xs.grad, eager[1])
    return median_ms(graph.replay), same


def layer_row(label: str, config: MoEConfig, x: torch.Tensor, upstream: torch.Tensor, ref: torch.Tensor | None,
              once: bool = False):
    """Prints the layer table's row for ``config``: its step eager and captured, whether that step is
    bitwise across the dispatchers and for 64 of its tokens alone, and its median per-token
    relative error against ``ref`` ('-' without one). Returns (output, input gradient, the step)."""
    _, step = layer_step(config, x, upstream, once=once)
    ms = median_ms(step)
    out, gx = step()
    graph_ms, replay_same = captured(config, x, upstream, (out, gx), once=once)
    out2, gx2 = layer_step(config.replace(dispatcher="allgather"), x, upstream, once=once)[1]()
    keep = torch.arange(0, x.shape[0], x.shape[0] // 64, device=x.device)[:64]
    out3, gx3 = layer_step(config, x[keep], upstream[keep], once=once)[1]()
    err = "-" if ref is None else f"{((out.float() - ref).norm(dim=1) / ref.norm(dim=1)).median().item():.3g}"
    same_kind = torch.equal(out, out2) and torch.equal(gx, gx2)
    same_alone = torch.equal(out3, out[keep]) and torch.equal(gx3, gx[keep])
    print(f"| {label} | {ms:.3f} | {graph_ms:.3f} | {replay_same} | {same_kind} | {same_alone} | {err} |", flush=True)
    return out, gx, step


def weight_grads(config: MoEConfig, x: torch.Tensor, upstream: torch.Tensor) -> list[torch.Tensor]:
    layer = MoELayer(config, layer_index=0).to(DEVICE)
    layer(x.detach().requires_grad_()).backward(upstream)
    return [p.grad.float() for p in layer.experts.parameters()]


def bench_wgrad_accumulation(config: MoEConfig, x: torch.Tensor, upstream: torch.Tensor, ref: torch.Tensor) -> None:
    """The FP8 step with wgrad's other accumulation (``experts.fp8.FAST_ACCUM_WGRAD`` flipped; the
    default is the FP8 MMA's fast accumulation), per call and with the weights quantised once: times,
    the same bitwise checks, and the expert weight gradients' relative change against the default."""
    from moe_dispatch.experts import fp8 as F

    default_setting = F.FAST_ACCUM_WGRAD
    default = weight_grads(config, x, upstream)
    F.FAST_ACCUM_WGRAD = not default_setting
    label = "fast" if F.FAST_ACCUM_WGRAD else "fp32-promoted"
    try:
        print(f"\n## wgrad with the other accumulation (FAST_ACCUM_WGRAD = {F.FAST_ACCUM_WGRAD}: {label})\n")
        print(LAYER_TABLE_HEADER)
        for once in (False, True):
            layer_row(f"fp8 e4m3, wgrad {label} accumulation{', weights quantised once' if once else ''}", config, x,
                      upstream, ref, once=once)
        other = weight_grads(config, x, upstream)
    finally:
        F.FAST_ACCUM_WGRAD = default_setting
    for i, (d, f) in enumerate(zip(default, other)):
        print(f"expert weight {i}'s gradient, {label} against the default accumulation: relative change "
              f"{((f - d).norm() / d.norm()).item():.3g}")


def bench_route(key: str, config: MoEConfig, x: torch.Tensor, upstream: torch.Tensor, ref: torch.Tensor,
                default: tuple, bf16_config: MoEConfig | None = None) -> None:
    """The FP8 step with the other value of the route ``LAUNCH[key]`` (``group_columns_tiles``:
    ``quantize_group_columns``' tiles; ``zero_only_uncovered``: zeros only in rows no slot points
    at), per call and with the weights quantised once: times, the same bitwise checks, its output,
    input gradient and expert weight gradients bitwise the default route's, and the weights'
    quantisation alone. With ``bf16_config``, the bf16 step's row too."""
    weights_default = weight_grads(config, x, upstream)
    other = not KT.LAUNCH[key]
    with KT.launch_settings(**{key: other}):
        print(f"\n## The other route: {key} = {other}\n")
        print(LAYER_TABLE_HEADER)
        if bf16_config is not None:
            layer_row(f"bf16, {key} = {other}", bf16_config, x, upstream, None)
        out, gx, _ = layer_row(f"fp8 e4m3, {key} = {other}", config, x, upstream, ref)
        layer_row(f"fp8 e4m3, {key} = {other}, weights quantised once", config, x, upstream, ref, once=True)
        same = torch.equal(out, default[0]) and torch.equal(gx, default[1]) and all(
            torch.equal(a, b) for a, b in zip(weight_grads(config, x, upstream), weights_default))
        layer = MoELayer(config, layer_index=0).to(DEVICE)
        print(f"\noutput, input and expert weight gradients bitwise the default route's: {same}; "
              f"layer.quantize_fp8_weights() alone: {median_ms(layer.quantize_fp8_weights):.3f} ms")


def bench_wide_wgrad(config: MoEConfig, x: torch.Tensor, upstream: torch.Tensor, ref: torch.Tensor,
                     default: tuple, bf16_config: MoEConfig) -> None:
    """The FP8 step with ``fp8_wgrad=False`` (the expert weight gradients in bf16 from the saved FP8
    rows widened by their scales), per call and with the weights quantised once: times, the same
    bitwise checks, its output and input gradient bitwise the FP8 step's, its expert weight gradients
    bitwise across the dispatchers, and each expert weight gradient's relative distance from the bf16
    layer's, with FP8 wgrad and without."""
    wide = config.replace(fp8_wgrad=False)
    print("\n## The expert weight gradients in bf16 (MoEConfig(fp8_wgrad=False))\n")
    print(LAYER_TABLE_HEADER)
    out, gx, _ = layer_row("fp8 e4m3, fp8_wgrad=False", wide, x, upstream, ref)
    layer_row("fp8 e4m3, fp8_wgrad=False, weights quantised once", wide, x, upstream, ref, once=True)
    configs = {"bf16": bf16_config, "fp8": config, "wide": wide, "wide allgather": wide.replace(dispatcher="allgather")}
    grads = {name: weight_grads(c, x, upstream) for name, c in configs.items()}
    same_kinds = all(torch.equal(a, b) for a, b in zip(grads["wide"], grads["wide allgather"]))
    same_rows = torch.equal(out, default[0]) and torch.equal(gx, default[1])
    print(f"\noutput and input gradient bitwise the FP8 step's: {same_rows}; expert weight gradients bitwise across "
          f"the dispatchers: {same_kinds}")
    for i, want in enumerate(grads["bf16"]):
        errors = [((grads[name][i] - want).norm() / want.norm()).item() for name in ("fp8", "wide")]
        print(f"expert weight {i + 1}'s gradient against bf16's (relative norm): FP8 wgrad {errors[0]:.3g}, "
              f"fp8_wgrad=False {errors[1]:.3g}")


CATEGORIES = [("GEMM", r"gemm|cutlass|nvjet|xmma|sm90_|grouped_mm|scaled_mm|f8f8"),
              ("quantise", r"quantize"), ("zero fill", r"fill|zero|cover_rows"),
              ("permute / combine", r"permute|unpermute|slots|gather|scatter|index"),
              ]


def group_columns_case(rows: int, cols: int, dtype: torch.dtype, experts: int, skewed: bool, seed: int = 0):
    """(x [rows, cols], row_starts, padded_starts, P, row_scales or None, bytes the op must move) for
    a wgrad operand: rows split over the experts at random (skewed: expert 0 takes half), each padded
    to 16; a float8 dtype gives quantised rows with their row scales (the saved forward input)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.ones(experts)
    if skewed:
        weights[0] = experts - 1.0
    counts = torch.bincount(torch.multinomial(weights, rows, replacement=True, generator=gen), minlength=experts)
    padded = torch.tensor([round_up(int(n), 16) for n in counts])
    starts = torch.stack([torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]),
                          torch.cat([torch.zeros(1, dtype=torch.int64), padded.cumsum(0)])]).to(DEVICE)
    x = torch.randn(rows, cols, generator=gen).to(DEVICE)
    row_scales = None
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        x, row_scales = quantize_rows(x, dtype)
    else:
        x = x.to(dtype)
    P = int(padded.sum())
    moved = rows * cols * x.element_size() + (0 if row_scales is None else rows * 4) + cols * P + experts * cols * 4
    return x, starts[0], starts[1], P, row_scales, moved


def bench_group_columns(args, bandwidth: float, sweep: bool = True) -> None:
    """The table of ``quantize_group_columns`` on the four wgrad operands: every route, or with
    ``args.no_routes`` the default alone; then the launch sweep when ``sweep``."""
    N, H, ffn, E = args.tokens * args.topk, args.hidden, args.ffn, args.experts
    print("\n## wgrad's column quantisation (ops.quantize_group_columns), against its byte floor\n")
    print("| operand | rows x cols, dtype | split | route | ms | floor ms | / floor | bitwise the first route |")
    print("|---|---|---|---|---|---|---|---|")
    routes = [("1 slice an expert", dict(group_columns_splits=1)), ("4 slices", dict(group_columns_splits=4)),
              ("8 slices", dict(group_columns_splits=8)), ("tiles of 128 rows", dict(group_columns_tiles=True)),
              ("tiles of 64 rows", dict(group_columns_tiles=True, group_columns_block_r=64)),
              ("tiles, 32 columns x 64 rows, 8 warps", dict(group_columns_tiles=True, group_columns_block_c=32,
                                                             group_columns_block_r=64, group_columns_warps=8))]
    routes = routes[:1] if args.no_routes else routes
    e4m3 = torch.float8_e4m3fn
    operands = [("fc1 x (saved rows, row scales)", H, e4m3), ("fc1 dy", ffn, torch.bfloat16),
                ("fc2 x (saved rows, row scales)", ffn, e4m3), ("fc2 dy", H, torch.bfloat16)]
    for name, cols, dtype in operands:
        for skewed in (False, True):
            x, s, p, P, rs, moved = group_columns_case(N, cols, dtype, E, skewed)
            floor = moved / bandwidth * 1e3
            want = None
            for route, knobs in routes:
                with KT.launch_settings(**knobs):
                    got = quantize_group_columns(x, s, p, P, e4m3, rs)
                    want = got if want is None else want
                    same = torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and \
                        torch.equal(got[1], want[1])
                    ms = graph_median_ms(lambda: quantize_group_columns(x, s, p, P, e4m3, rs))
                print(f"| {name} | {N} x {cols}, {str(dtype)[6:]} | {'one expert half' if skewed else 'random'} | "
                      f"{route} | {ms:.4f} | {floor:.4f} | {ms / floor:.2f} | {same} |", flush=True)
    for name, cols, dtype in (("fc2 dy", H, torch.bfloat16), ("fc2 x", ffn, e4m3)) if sweep else ():
        x, s, p, P, rs, moved = group_columns_case(N, cols, dtype, E, False)
        floor = moved / bandwidth * 1e3
        print(f"\nLAUNCH sweep, {name} ({N} x {cols} {str(dtype)[6:]}, random split; floor {floor:.4f} ms)\n")
        print("| block_c | block_r | warps | slices | ms | / floor |\n|---|---|---|---|---|---|")
        # ptxas -v (sm_90) registers a thread: 64 x 128 over 4 warps 254 (two programs per SM),
        # 32 x 64 over 8 warps 64, 32 x 32 or 64 x 16 over 4 warps 88, 64 x 32 over 8 warps 95.
        for block_c, block_r, warps, splits in [
                (64, 128, 4, 1), (32, 64, 4, 1), (64, 64, 4, 1), (64, 32, 4, 1), (64, 64, 8, 1), (32, 64, 8, 1),
                (32, 32, 4, 1), (64, 16, 4, 1), (64, 32, 8, 1), (32, 128, 8, 1), (128, 32, 8, 1),
                (64, 128, 4, 4), (32, 64, 8, 4), (32, 32, 4, 4), (64, 32, 8, 4), (32, 64, 8, 8)]:
            with KT.launch_settings(group_columns_block_c=block_c, group_columns_block_r=block_r,
                                    group_columns_warps=warps, group_columns_splits=splits, group_columns_tiles=False):
                ms = graph_median_ms(lambda: quantize_group_columns(x, s, p, P, e4m3, rs))
            print(f"| {block_c} | {block_r} | {warps} | {splits} | {ms:.4f} | {ms / floor:.2f} |", flush=True)


def bench_quantize_rows_launch(rows_list: list[int], H: int, bandwidth: float) -> None:
    """quantize_rows' LAUNCH settings (none changes a value; each result checked bitwise against the
    default's)."""
    print("\n| rows x H | elements | warps | programs per SM | stages | ms | / floor | bitwise default |")
    print("|---|---|---|---|---|---|---|---|")
    for rows in rows_list:
        xr = torch.randn(rows, H, device=DEVICE).to(torch.bfloat16)
        want = quantize_rows(xr, torch.float8_e4m3fn)
        floor = row_quantisation_bytes(rows, H, 2) / bandwidth * 1e3
        # Rows of H <= elements load once and stay in registers (one pass; 8192 elements over
        # 8 warps take 199 registers a thread for sm_90, per ptxas -v: one program per SM);
        # elements < H read each row twice, chunk by chunk (32-48 registers a thread, so many
        # programs per SM; the second read likely from L2).
        for elements, warps, per_sm, stages in [
                (8192, 8, 0, 1), (4096, 4, 0, 1), (4096, 8, 0, 1), (4096, 16, 0, 1), (16384, 16, 0, 1),
                (2048, 4, 0, 1), (2048, 8, 0, 1), (1024, 2, 0, 1), (1024, 4, 0, 1), (1024, 8, 0, 1),
                (512, 4, 0, 1), (1024, 4, 8, 2), (1024, 4, 16, 2), (2048, 8, 8, 2), (4096, 8, 4, 2),
                (8192, 8, 2, 3)]:
            try:
                with KT.launch_settings(quantize_elements=elements, quantize_warps=warps,
                                        quantize_programs_per_sm=per_sm, quantize_stages=stages):
                    got = quantize_rows(xr, torch.float8_e4m3fn)
                    ms = graph_median_ms(lambda xr=xr: quantize_rows(xr, torch.float8_e4m3fn))
            except Exception as exc:  # a setting the compiler refuses (e.g. shared memory)
                print(f"| {rows} x {H} | {elements} | {warps} | {per_sm} | {stages} | {type(exc).__name__} | | |")
                continue
            same = all(torch.equal(u.view(torch.uint8) if u.dtype != torch.float32 else u,
                                   v.view(torch.uint8) if v.dtype != torch.float32 else v)
                       for u, v in zip(want, got))
            print(f"| {rows} x {H} | {elements} | {warps} | {per_sm} | {stages} | {ms:.4f} | {ms / floor:.2f} | "
                  f"{same} |", flush=True)


def row_quantisation_bytes(n: int, cols: int, in_bytes: int) -> int:
    """The least bytes a row quantisation moves: n rows of ``in_bytes`` elements read, float8 and
    a fp32 scale per row written."""
    return n * cols * (in_bytes + 1) + 4 * n


def quantisation_floor(T: int, H: int, ffn: int, E: int, K: int) -> list[tuple[str, int]]:
    """(what, bytes) of each quantisation in one FP8 step of the layer (gelu: fc1 is [E, H, ffn]),
    at the least: its input read once, the float8 values and the fp32 scales written once. The
    weights are quantised twice per call (per output column for the forward, along the other axis
    for dgrad); the weight gradient's operands per (expert, column)."""
    N = T * K
    rows = row_quantisation_bytes
    weight = E * H * ffn
    return [
        ("tokens, before the dispatch", rows(T, H, 2)),
        ("fc1 weight, forward (per output column)", 3 * weight + 4 * E * ffn),
        ("fc2 weight, forward", 3 * weight + 4 * E * H),
        ("the activation rows (fc2's input)", rows(N, ffn, 2)),
        ("fc2's output gradient rows (dgrad)", rows(N, H, 2)),
        ("fc2 weight, dgrad (the other axis)", 3 * weight + 4 * E * ffn),
        ("fc1's output gradient rows", rows(N, ffn, 2)),
        ("fc1 weight, dgrad", 3 * weight + 4 * E * H),
        ("wgrad fc1 x (the saved float8 rows and their scales)", N * H * 2 + 4 * N + 4 * E * H),
        ("wgrad fc1 dy", N * ffn * 3 + 4 * E * ffn),
        ("wgrad fc2 x (the saved float8 activation rows)", N * ffn * 2 + 4 * N + 4 * E * ffn),
        ("wgrad fc2 dy", N * H * 3 + 4 * E * H),
    ]


def print_quantisation_floor(args, bandwidth: float) -> None:
    """The table of ``quantisation_floor`` at ``bandwidth`` bytes/s (read + write)."""
    parts = quantisation_floor(args.tokens, args.hidden, args.ffn, args.experts, args.topk)
    print(f"\n## The FP8 step's quantisations at their byte floor ({bandwidth / 1e12:.2f} TB/s, read + write)\n")
    print("| quantisation | MB moved | floor ms |\n|---|---|---|")
    for what, moved in parts:
        print(f"| {what} | {moved / 1e6:.1f} | {moved / bandwidth * 1e3:.4f} |")
    total = sum(moved for _, moved in parts)
    weights = sum(moved for what, moved in parts if "weight" in what)
    print(f"| **all** (the weights' four: {weights / bandwidth * 1e3:.4f} ms) | {total / 1e6:.1f} | "
          f"**{total / bandwidth * 1e3:.4f}** |")


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(parser)
    parser.add_argument("--no-sweeps", action="store_true",
                        help="skip the quantisers' LAUNCH sweeps (the tables at the defaults still print)")
    parser.add_argument("--no-accumulation", action="store_true",
                        help="skip the rows with wgrad's other accumulation (FAST_ACCUM_WGRAD flipped)")
    parser.add_argument("--layer-only", action="store_true",
                        help="only the layer table's rows (bf16, FP8, FP8 with fp8_wgrad=False), then stop")
    parser.add_argument("--kernels-only", action="store_true",
                        help="only table 2 (the quantisers against their floors and their sweeps), then stop")
    parser.add_argument("--no-routes", action="store_true",
                        help="skip the LAUNCH routes' rows (group_columns_tiles, zero_only_uncovered)")
    parser.add_argument("--floor-only", type=float, metavar="TB_PER_S", default=None,
                        help="print only the quantisations' byte-floor table at this copy bandwidth (no GPU)")
    args = parser.parse_args()
    if args.floor_only is not None:
        print_quantisation_floor(args, args.floor_only * 1e12)
        return
    if args.kernels_only:
        bench_quantisers(args)
        return
    T, H = args.tokens, args.hidden
    x, upstream = layer_inputs(T, H)
    base = dict(hidden_size=H, num_experts=args.experts, topk=args.topk, ffn_hidden_size=args.ffn,
                params_dtype=torch.bfloat16)

    print(f"## The layer, forward + backward, EP 1 ({T} tokens, H {H}, ffn {args.ffn}, E {args.experts}, "
          f"K {args.topk}, bf16 tokens, eager)\n")
    print(LAYER_TABLE_HEADER)
    ref = layer_row("bf16", MoEConfig(**base), x, upstream, None)[0].float()
    out, gx, fp8_step = layer_row("fp8 e4m3", MoEConfig(fp8="e4m3", **base), x, upstream, ref)
    config = MoEConfig(fp8="e4m3", **base)
    layer, step = layer_step(config, x, upstream, once=True)
    ms = median_ms(step)
    out_once, gx_once = step()
    graph_ms, replay_same = captured(config, x, upstream, (out_once, gx_once), once=True)
    same_per_call = torch.equal(out_once, out) and torch.equal(gx_once, gx)
    print(f"| fp8 e4m3, weights quantised once | {ms:.3f} | {graph_ms:.3f} | {replay_same} | "
          f"bitwise the per-call fp8 step: {same_per_call} | | |")
    quantise_ms = median_ms(layer.quantize_fp8_weights)
    print(f"\nlayer.quantize_fp8_weights() alone (both weights, forward and dgrad operands): {quantise_ms:.3f} ms")
    bench_wide_wgrad(config, x, upstream, ref, (out, gx), MoEConfig(**base))
    if args.layer_only:
        return
    if not args.no_accumulation:
        bench_wgrad_accumulation(config, x, upstream, ref)
    if not args.no_routes:
        bench_route("group_columns_tiles", config, x, upstream, ref, (out, gx))
        bench_route("zero_only_uncovered", config, x, upstream, ref, (out, gx), bf16_config=MoEConfig(**base))
    bench_quantisers(args)

    profile_step("bf16", layer_step(MoEConfig(**base), x, upstream)[1])
    profile_step("FP8 per call", fp8_step)
    profile_step("FP8, the weights quantised once", layer_step(config, x, upstream, once=True)[1])
    profile_step("FP8 with fp8_wgrad=False, the weights quantised once",
                 layer_step(config.replace(fp8_wgrad=False), x, upstream, once=True)[1])
    if args.no_routes:
        return
    both = {key: not KT.LAUNCH[key] for key in ("group_columns_tiles", "zero_only_uncovered")}
    with KT.launch_settings(**both):
        print(f"\n## Both other routes at once ({both})\n")
        print(LAYER_TABLE_HEADER)
        layer_row("fp8 e4m3, both other routes, weights quantised once", config, x, upstream, ref, once=True)
        profile_step("FP8, the weights quantised once, both other routes",
                     layer_step(config, x, upstream, once=True)[1])


def bench_quantisers(args: argparse.Namespace) -> None:
    """Table 2: the quantisers and the dequantiser against their byte floors, then the sweeps."""
    T, H = args.tokens, args.hidden
    print("\n## Row quantisation (ops.quantize_rows), against its byte floor\n")
    src = torch.empty(T, H, dtype=torch.bfloat16, device=DEVICE)
    dst = torch.empty_like(src)
    copy_ms = graph_median_ms(lambda: dst.copy_(src))
    bandwidth = 2 * src.numel() * src.element_size() / (copy_ms * 1e-3)  # read + write, bytes/s
    print(f"device-to-device copy of [{T}, {H}] bf16: {copy_ms:.4f} ms, {bandwidth / 1e12:.2f} TB/s (read + write)\n")
    print("| rows | ms | floor ms | / floor |\n|---|---|---|---|")
    # the tokens, the fc2 gradient rows (dgrad), and fc2's input / fc1's gradient rows (ffn wide)
    for rows, cols in ((T, H), (T * args.topk, H), (T * args.topk, args.ffn)):
        xr = torch.randn(rows, cols, device=DEVICE).to(torch.bfloat16)
        ms = graph_median_ms(lambda xr=xr: quantize_rows(xr, torch.float8_e4m3fn))
        moved = row_quantisation_bytes(rows, cols, 2)  # bf16 in
        floor = moved / bandwidth * 1e3
        print(f"| {rows} x {cols} | {ms:.4f} | {floor:.4f} | {ms / floor:.2f} |")
    for rows, cols in ((T * args.topk, H), (T * args.topk, args.ffn)):  # fp8_wgrad=False's widening
        q, scales = quantize_rows(torch.randn(rows, cols, device=DEVICE), torch.float8_e4m3fn)
        ms = graph_median_ms(lambda q=q, scales=scales: dequantize_rows(q, scales, torch.bfloat16))
        floor = (rows * cols * 3 + rows * 4) / bandwidth * 1e3  # fp8 in, bf16 out, the scales
        print(f"| dequantize_rows {rows} x {cols} to bf16 | {ms:.4f} | {floor:.4f} | {ms / floor:.2f} |")
    if not args.no_sweeps:
        bench_quantize_rows_launch([T, T * args.topk], H, bandwidth)
    bench_group_columns(args, bandwidth, sweep=not args.no_sweeps)
    print_quantisation_floor(args, bandwidth)


def profile_step(label: str, step) -> None:
    """Prints where ``step``'s CUDA time goes (torch.profiler over 5 steps, per step): by category,
    the top 20 kernels, and the top 20 operators by the GPU time of the kernels they launched."""
    print(f"\n## Where the step's CUDA time goes, {label} (torch.profiler, 5 steps, per step)\n")
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue  # kernels only: CPU operators carry their kernels' time too
        us = event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
        if us <= 0:
            continue
        totals[category(event.key)] = totals.get(category(event.key), 0.0) + us / 5
        kernels[event.key] = kernels.get(event.key, 0.0) + us / 5
    whole = sum(totals.values())
    print(f"all kernels: {whole / 1e3:.3f} ms per step\n")
    print("| category | ms per step | share |\n|---|---|---|")
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {us / 1e3:.3f} | {us / whole:.0%} |")
    print("\n| kernel (top 20) | category | ms per step |\n|---|---|---|")
    for name, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:20]:
        print(f"| {name[:110]} | {category(name)} | {us / 1e3:.3f} |")
    print("\n| operator (top 20 by the GPU time of its own kernels) | input shapes | ms per step |\n|---|---|---|")
    ops = [e for e in prof.key_averages(group_by_input_shape=True)
           if e.device_type == torch.autograd.DeviceType.CPU and _self_device_us(e) > 0]
    for e in sorted(ops, key=lambda e: -_self_device_us(e))[:20]:
        print(f"| {e.key} | {str(e.input_shapes)[:100]} | {_self_device_us(e) / 5e3:.3f} |")


def _self_device_us(event) -> float:
    """The GPU time of the kernels an operator launched itself (torch 2.11+ names it device time)."""
    return event.self_device_time_total if hasattr(event, "self_device_time_total") else event.self_cuda_time_total


if __name__ == "__main__":
    main()

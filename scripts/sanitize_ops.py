"""Run the permutation and quantisation ops on CUDA over the calls the GPU op tests make and over
adversarial inputs, checking every result; made to run under compute-sanitizer's memcheck:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 3 \\
        python3 scripts/sanitize_ops.py

(without caching every tensor is its own allocation: the caching allocator's large blocks hide
writes past a tensor's end). Each case prints PASS or FAIL with what it checked; a summary
follows. Exit status 1 if any result is wrong; memcheck's own findings give --error-exitcode.

Adversarial cases: tokens_per_expert short, long, and with the right sum but the wrong split;
max_experts_per_token below a token's expert count (forward and backward); NaN and inf probs in
permute and unpermute; slots naming rows past the buffers (kernels called directly); a gather
index out of range. Each must give the CPU twin's ValueError (deferred on CUDA: see
moe_dispatch/ops/guard.py), NaN in the poisoned results, and a correct result on the next call.
Every case runs twice: with the default routes, and with LAUNCH's alternative routes
(unpermute_bwd_per_token; quantize_rows' strided programs with pipelined loads; three slices per
expert in quantize_group_columns), and once more with quantize_group_columns' tiled route.

The quantisers (``quantize_rows``, ``quantize_group_columns``): bitwise the CPU twin over zero,
tiny, inf and NaN rows, strided inputs (the FP8 wire's rows read in place), float8 input with row
scales, experts of no rows and counts off the multiple of 16 with the weight gradient's slack
group; and starts that break the contract (past N, padding narrower than the rows), where CUDA
promises only that every access stays in bounds.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Callable

import torch

from moe_dispatch.ops import check_device_errors, permute, set_backend, sort_chunks, unpermute
from moe_dispatch.ops import torch_twin as TW

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def routing(T: int, E: int, K: int, seed: int, H: int = 200) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(routing_map [T, E] bool with K experts per token, tokens [T, H] fp32, probs [T, E] fp32), CPU."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.rand((T, E), generator=gen).topk(K, dim=1).indices
    routing_map = torch.zeros((T, E), dtype=torch.bool).scatter_(1, idx, True)
    return routing_map, torch.randn((T, H), generator=gen), torch.rand((T, E), generator=gen) * routing_map


def run(tokens, routing_map, probs, y, g_out, **kw) -> dict:
    """permute then unpermute, forward and backward; every output and gradient."""
    tok = tokens.clone().requires_grad_()
    pr = probs.clone().requires_grad_() if probs is not None else None
    permuted, permuted_probs, rmap = permute(tok, routing_map, pr, **kw)
    y = y.clone().requires_grad_()
    out = unpermute(y, rmap, pr)
    loss = (out.double() * g_out.double()).sum() + (permuted.double() * y.detach().double()).sum()
    if permuted_probs is not None:
        loss = loss + permuted_probs.double().sum()
    loss.backward()
    return {"permuted": permuted.detach(), "out": out.detach(), "grad_tokens": tok.grad, "grad_rows": y.grad,
            "grad_probs": None if pr is None else pr.grad, "slots": rmap.slots}


DEVICE = "cuda"  # --device cpu: a smoke run of this script under TRITON_INTERPRET=1


def cuda(*tensors):
    return [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in tensors]


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def twin_error(call: Callable[[], object]) -> str:
    with set_backend("torch"):
        try:
            call()
        except ValueError as exc:
            return str(exc)
    raise AssertionError("the CPU twin accepted the input")


def expect_deferred(call_cuda: Callable[[], dict], message: str, poisoned: list[str]) -> str:
    """call_cuda's results named in ``poisoned`` hold NaN, then check_device_errors raises ``message``."""
    try:
        results = call_cuda()
    except ValueError as exc:  # raised by the call itself: it synchronised, or a poll found the check done
        assert str(exc) == message, f"CUDA raised {exc!r}, the twin {message!r}"
        return "raised by the call, same message as the twin"
    for key in poisoned:
        assert results[key].isnan().any(), f"{key} not poisoned"
    try:
        check_device_errors()
    except ValueError as exc:
        assert str(exc) == message, f"CUDA raised {exc!r}, the twin {message!r}"
        return f"poisoned {', '.join(poisoned)}; deferred ValueError, same message as the twin"
    raise AssertionError("no ValueError on CUDA")


def assert_close_probs_grad(a: torch.Tensor, b: torch.Tensor, y: torch.Tensor, g: torch.Tensor) -> None:
    H = y.shape[1]
    scale = float(y.double().abs().max() * g.double().abs().max()) * H
    assert float((a.double() - b.double()).abs().max()) <= 2 * H * 2.0 ** -24 * scale + 1e-30


# ---------------------------------------------------------------------------------------------
# The GPU op tests' calls: CUDA against the CPU twin.
# ---------------------------------------------------------------------------------------------
def case_matches_twin(dtype, probs_dtype, pad_multiple, T=512, E=64, K=6, H=1000) -> str:
    routing_map, tokens, probs = routing(T, E, K, seed=21, H=H)
    tokens, probs = tokens.to(dtype), probs.to(probs_dtype)
    counts = routing_map.sum(0)
    N = int(((counts + pad_multiple - 1) // pad_multiple * pad_multiple).sum())
    gen = torch.Generator().manual_seed(1)
    y, g_out = torch.randn((N, H), generator=gen).to(dtype), torch.randn((T, H), generator=gen).to(dtype)
    args = (tokens, routing_map, probs, y, g_out)
    with set_backend("torch"):
        cpu = run(*args, pad_multiple=pad_multiple)
    gpu = run(*cuda(*args), pad_multiple=pad_multiple)
    for key in ["slots", "permuted", "out", "grad_tokens", "grad_rows"]:
        assert torch.equal(cpu[key], gpu[key].cpu()), key
    assert_close_probs_grad(cpu["grad_probs"], gpu["grad_probs"].cpu(), y, g_out)
    gpu2 = run(*cuda(*args), pad_multiple=pad_multiple, tokens_per_expert=counts.tolist(), max_experts_per_token=K)
    for key in gpu:
        assert torch.equal(gpu[key], gpu2[key]), f"counts known: {key}"
    check_device_errors()
    return "bitwise = twin (probs grad within rounding); counts-known path equal"


def case_edges() -> str:
    routing_map, tokens, probs = routing(40, 8, 2, seed=3)
    routing_map[5] = False
    routing_map[:, 3] = False
    probs = probs * routing_map
    tokens, routing_map, probs = cuda(tokens, routing_map, probs)
    permuted, permuted_probs, rmap = permute(tokens, routing_map, probs, num_out_tokens=200)
    routed = int(rmap.expert_rows.sum())
    assert torch.equal(permuted[routed:], torch.zeros_like(permuted[routed:]))
    out = unpermute(permuted, rmap, probs, restore_shape=(40, 1, 200))
    assert out.shape == (40, 1, 200) and torch.equal(out[5], torch.zeros_like(out[5]))
    empty = permute(tokens[:0], routing_map[:0], probs[:0])
    assert empty[0].shape == (0, 200) and unpermute(empty[0], empty[2], probs[:0]).shape == (0, 200)
    wide = torch.randn(40, 400, device=DEVICE)[:, ::2]
    a = permute(wide, routing_map, probs)[0]
    b = permute(wide.contiguous(), routing_map, probs)[0]
    assert torch.equal(a, b)
    x = torch.randn(10, 33, device=DEVICE, requires_grad=True)
    out, _ = sort_chunks(x, [3, 0, 5, 2], [2, 0, 3, 1])
    out.sum().backward()
    assert torch.equal(out.detach(), torch.cat([x[3:8], x[0:3], x[8:10]]).detach())
    check_device_errors()
    return "extra rows zero, token routed nowhere, empty batch, strided tokens, sort_chunks"


def case_int64_offsets() -> str:
    """N * H >= 2^31 (the TransformerEngine #2908 class): offsets in int64."""
    T, E, K, H = 131072, 8, 4, 4160
    gen = torch.Generator().manual_seed(0)
    idx = torch.rand((T, E), generator=gen).topk(K, dim=1).indices
    routing_map = torch.zeros((T, E), dtype=torch.bool).scatter_(1, idx, True).to(DEVICE)
    tokens = torch.randn((T, H), device=DEVICE, dtype=torch.bfloat16)
    probs = torch.rand((T, E), device=DEVICE) * routing_map
    permuted, _, rmap = permute(tokens, routing_map, probs)
    assert permuted.shape[0] * H >= 2 ** 31
    last = rmap.slots[-1].tolist()
    for j in range(last[0]):
        assert torch.equal(permuted[last[1 + j]], tokens[-1])
    out = unpermute(permuted, rmap, probs)
    acc = torch.zeros((64, H), device=DEVICE)
    for e in range(E):  # ascending experts, fp32, multiply then add (or fused, as the kernel)
        routed = routing_map[-64:, e:e + 1]
        if TW.NUMERICS["unpermute_fma"]:
            acc = torch.where(routed, TW.fma32(probs[-64:, e:e + 1], tokens[-64:].float(), acc), acc)
        else:
            acc = acc + probs[-64:, e:e + 1] * tokens[-64:].float()
    assert torch.equal(out[-64:], acc.to(torch.bfloat16))
    del permuted, out
    return f"N*H = {T * K * H:.3g} elements, last rows and tokens bitwise"


# ---------------------------------------------------------------------------------------------
# Adversarial input.
# ---------------------------------------------------------------------------------------------
def sizes_case(make_counts: Callable[[list[int]], list[int]], most_delta: int, pad_multiple: int = 1) -> str:
    T, E, K, H = 300, 16, 4, 200
    routing_map, tokens, probs = routing(T, E, K, seed=7)
    counts = routing_map.sum(0).tolist()
    given, most = make_counts(counts), K + most_delta
    kw = dict(tokens_per_expert=given, max_experts_per_token=most, pad_multiple=pad_multiple)
    message = twin_error(lambda: permute(tokens, routing_map, probs, **kw))
    N = sum((c + pad_multiple - 1) // pad_multiple * pad_multiple for c in given)
    gen = torch.Generator().manual_seed(2)
    y, g_out = torch.randn((N, H), generator=gen), torch.randn((T, H), generator=gen)
    args = cuda(tokens, routing_map, probs, y, g_out)
    how = expect_deferred(lambda: run(*args, **kw), message,
                          ["permuted", "out", "grad_tokens", "grad_rows", "grad_probs"])
    good = run(*args[:3], *cuda(*[torch.randn((sum(counts), H)), g_out]), tokens_per_expert=counts)
    check_device_errors()
    assert not any(v.isnan().any() for v in good.values() if v is not None), "poison left after the error"
    return how


def _swap(counts: list[int]) -> list[int]:
    out = list(counts)
    i = next(e for e, c in enumerate(out) if c > 0)
    out[i] -= 1
    out[(i + 1) % len(out)] += 1
    return out


def nonfinite_case(value: float, where: str) -> str:
    routing_map, tokens, probs = routing(300, 16, 4, seed=9)
    bad = probs.clone()
    e = int(routing_map[7].nonzero()[0]) if where == "routed" else int((~routing_map[7]).nonzero()[0])
    bad[7, e] = value
    counts = routing_map.sum(0).tolist()
    results = []
    for kw in ({}, {"tokens_per_expert": counts}):
        message = twin_error(lambda: permute(tokens, routing_map, bad, **kw))
        tok, rm, pr = cuda(tokens, routing_map, bad)
        results.append("permute" + (" (counts known)" if kw else "") + ": " + expect_deferred(
            lambda: dict(zip(["permuted", "probs"], permute(tok, rm, pr, **kw)[:2])), message, ["permuted"]))
    with set_backend("torch"):
        permuted, _, rmap = permute(tokens, routing_map)
    message = twin_error(lambda: unpermute(permuted, rmap, bad))
    p_cuda, (tok, rm, pr) = permuted.to(DEVICE), cuda(tokens, routing_map, bad)
    rmap_cuda = permute(tok, rm)[2]
    results.append("unpermute: " + expect_deferred(lambda: {"out": unpermute(p_cuda, rmap_cuda, pr)}, message, []))
    return "; ".join(results)


def kernel_bounds_case() -> str:
    """Slots naming rows past the buffers, n_t past the backward's bound, an out-of-range gather
    index: the kernels called directly (no host check in front), against the twin's semantics."""
    from moe_dispatch.ops import kernels as K

    routing_map, tokens, probs = routing(300, 16, 4, seed=4)
    slots, stats = TW.make_slots(routing_map, 1)
    N = int(stats[:-1].sum()) - 37
    gen = torch.Generator().manual_seed(5)
    y, g = torch.randn((N, 200), generator=gen), torch.randn((300, 200), generator=gen)
    gp = torch.randn(N, generator=gen)
    c_tokens, c_slots, c_probs, c_y, c_g, c_gp = cuda(tokens, slots, probs, y, g, gp)
    a = K.permute_rows(c_tokens, c_slots, c_probs, N, True)
    b = TW.permute_rows(tokens, slots, probs, N, True)
    assert torch.equal(a[0].cpu(), b[0]) and torch.equal(a[1].cpu(), b[1])
    assert torch.equal(K.unpermute_rows(c_y, c_slots, c_probs).cpu(), TW.unpermute_rows(y, slots, probs))
    a = K.permute_rows_backward(c_y, c_slots, c_gp, torch.float32)
    b = TW.permute_rows_backward(y, slots, gp, torch.float32)
    assert torch.equal(a[0].cpu(), b[0]) and torch.equal(a[1].cpu(), b[1])
    for max_slots in (4, 2, 1):
        a = K.unpermute_rows_backward(c_g, c_y, c_slots, c_probs, True, max_slots)
        b = TW.unpermute_rows_backward(g, y, slots, probs, True, max_slots)
        assert torch.equal(a[0].cpu(), b[0]) and torch.equal(a[1].isnan().cpu(), b[1].isnan())
    index = torch.tensor([0, N + 1000, 3, -5, N - 1], device=DEVICE)
    out = K.gather_rows(c_y, index)
    assert torch.equal(out[[1, 3]].cpu(), torch.zeros(2, 200)) and torch.equal(out[[0, 2, 4]], c_y[[0, 3, N - 1]])
    synchronize()
    check_device_errors()
    return f"rows past N={N} skipped, bound 4/2/1 below n_t=4 gives NaN probs-grad rows, bad index reads nothing"


def _quantise_input(T: int, C: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[T, C] of ``dtype``, a view with row stride C + 16 (as the wire's rows), with a zero row, a
    row below 2^-64, an inf and a NaN row where T allows."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn((T, C + 16), generator=gen) * torch.logspace(-3, 3, T).unsqueeze(1) if T else \
        torch.zeros((0, C + 16))
    for row, value in zip(range(1, T, 5), (0.0, 1e-30, float("inf"), float("nan"))):
        wide[row] = value if value != 1e-30 else wide[row] * value
    return wide.to(dtype)[:, :C]


def case_quantisers() -> str:
    """quantize_rows, dequantize_rows and quantize_group_columns: CUDA against the twin, bitwise."""
    from moe_dispatch.experts.fp8 import wgrad_layout
    from moe_dispatch.ops import dequantize_rows, quantize_group_columns, quantize_rows

    checked = 0
    for dtype in DTYPES if DEVICE == "cuda" else [torch.float32]:
        for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
            for T, C in ((0, 32), (1, 16), (37, 48), (300, 1000)):
                x = _quantise_input(T, C, dtype, seed=T + C)
                with set_backend("torch"):
                    want = quantize_rows(x, fp8)
                got = quantize_rows(x.to(DEVICE), fp8)
                assert torch.equal(got[0].view(torch.uint8).cpu(), want[0].view(torch.uint8)), (dtype, fp8, T, C)
                assert torch.equal(got[1].cpu().nan_to_num(-1.0), want[1].nan_to_num(-1.0)), (dtype, fp8, T, C)
                checked += 1
                # dequantize_rows back to dtype, on the rows read in place at a row stride above C
                wide = torch.cat([want[0].view(torch.uint8), want[0].view(torch.uint8)[:, :16]], 1).view(fp8)
                with set_backend("torch"):
                    back = dequantize_rows(wide[:, :C], want[1], dtype)
                got_back = dequantize_rows(wide.to(DEVICE)[:, :C], want[1].to(DEVICE), dtype).cpu()
                assert torch.equal(got_back.nan_to_num(-1.0), back.nan_to_num(-1.0)), ("dequantize", dtype, fp8, T, C)
                checked += 1
                for counts in ([0, 5, 0, 16, T - 21] if T >= 21 else [T], [T, 0, 0]):
                    row_ends = torch.tensor(counts).cumsum(0)
                    row_starts, padded_starts, padded = wgrad_layout(row_ends, T)
                    scales = None
                    if dtype == torch.float32:  # float8 rows with their scales, as the wgrad's saved x
                        x8, scales = quantize_rows(x.cpu(), torch.float8_e4m3fn)
                        xin = x8
                    else:
                        xin = x
                    with set_backend("torch"):
                        want = quantize_group_columns(xin, row_starts, padded_starts, padded, fp8, scales)
                    dev = [t.to(DEVICE) if t is not None else None for t in (xin, row_starts, padded_starts, scales)]
                    got = quantize_group_columns(dev[0], dev[1], dev[2], padded, fp8, dev[3])
                    assert torch.equal(got[0].view(torch.uint8).cpu(), want[0].view(torch.uint8)), (dtype, T, counts)
                    assert torch.equal(got[1].cpu().nan_to_num(-1.0), want[1].nan_to_num(-1.0)), (dtype, T, counts)
                    checked += 1
    # starts breaking the contract: rows past N, padding narrower than an expert's rows (CUDA: in bounds)
    x = torch.randn(40, 64, device=DEVICE)
    for starts, padded in (([0, 30, 80], [0, 32, 96]), ([0, 20, 40], [0, 8, 16]), ([0, 40, 10], [0, 48, 64])):
        s_rows = torch.tensor(starts, device=DEVICE)
        s_pad = torch.tensor(padded, device=DEVICE)
        quantize_group_columns(x, s_rows, s_pad, padded[-1], torch.float8_e4m3fn)
        synchronize()
    return f"{checked} calls bitwise the twin; 3 contract-breaking start sets ran"


def main() -> None:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-large", action="store_true", help="skip the N*H >= 2^31 case (9 GB, slow under memcheck)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: check this script itself with the kernels under TRITON_INTERPRET=1 (fp32, "
                             "no large case); it says nothing about memory safety on the GPU")
    parser.add_argument("--only", default=None, metavar="TEXT",
                        help="run only the cases whose name (route prefix included) contains TEXT")
    args = parser.parse_args()
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("sanitize_ops.py needs a CUDA device (or --device cpu with TRITON_INTERPRET=1)")
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--device cpu needs TRITON_INTERPRET=1 in the environment")
    backend = set_backend("triton" if DEVICE == "cpu" else "auto")
    backend.__enter__()
    cases: list[tuple[str, Callable[[], str]]] = []
    for dtype in DTYPES if DEVICE == "cuda" else [torch.float32]:
        for probs_dtype, pad in [(torch.float32, 1), (torch.float64, 1), (torch.float32, 16)]:
            cases.append((f"twin match {str(dtype)[6:]} probs {str(probs_dtype)[6:]} pad {pad}",
                          lambda d=dtype, p=probs_dtype, m=pad: case_matches_twin(d, p, m)))
    cases.append(("edge cases", case_edges))
    if not args.no_large and DEVICE == "cuda":
        cases.append(("int64 offsets", case_int64_offsets))
    cases += [
        ("tokens_per_expert short", lambda: sizes_case(lambda c: [max(0, v - 1) for v in c], 0)),
        ("tokens_per_expert short, pad 8", lambda: sizes_case(lambda c: [max(0, v - 1) for v in c], 0, 8)),
        ("tokens_per_expert long", lambda: sizes_case(lambda c: [v + 2 for v in c], 0)),
        ("tokens_per_expert right sum, wrong split", lambda: sizes_case(_swap, 0)),
        ("tokens_per_expert all on expert 0", lambda: sizes_case(lambda c: [sum(c)] + [0] * (len(c) - 1), 0)),
        ("max_experts_per_token below n_t (fwd + bwd)", lambda: sizes_case(lambda c: c, -2)),
        ("max_experts_per_token 1 (fwd + bwd)", lambda: sizes_case(lambda c: c, -3)),
        ("probs NaN (routed)", lambda: nonfinite_case(float("nan"), "routed")),
        ("probs inf (routed)", lambda: nonfinite_case(float("inf"), "routed")),
        ("probs -inf (not routed)", lambda: nonfinite_case(float("-inf"), "unrouted")),
        ("kernels on slots past their buffers", kernel_bounds_case),
        ("quantisers", case_quantisers),
    ]
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU, Triton interpreter"
    print(f"# {name}, torch {torch.__version__}; "
          f"PYTORCH_NO_CUDA_MEMORY_CACHING={os.environ.get('PYTORCH_NO_CUDA_MEMORY_CACHING', '(unset)')}")
    from moe_dispatch.ops import kernels as KT

    routes = [("", {}), ("[alt route] ", {"unpermute_bwd_per_token": True, "quantize_programs_per_sm": 2,
                                           "quantize_stages": 2, "group_columns_splits": 3}),
              ("[tiles, full fill] ", {"group_columns_tiles": True, "zero_only_uncovered": False})]
    cases = [(prefix + name, case, knobs) for prefix, knobs in routes for name, case in cases
             if not (knobs and name == "int64 offsets") and (args.only is None or args.only in prefix + name)]
    failed = []
    for name, case, knobs in cases:
        try:
            with KT.launch_settings(**knobs):
                detail = case()
                synchronize()
            print(f"PASS  {name}: {detail}", flush=True)
        except Exception as exc:  # report every case, then fail the run
            failed.append(name)
            print(f"FAIL  {name}: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc()
            try:
                check_device_errors()  # clear what the failed case left
            except ValueError:
                pass
    print(f"\n{len(cases) - len(failed)} of {len(cases)} cases passed"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

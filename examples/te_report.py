"""TransformerEngine issue #1336, re-run on this package's kernels.

The report compared TE's ``moe_permute`` / ``moe_unpermute`` (TE 1.x, index maps) with a PyTorch
reference in fp32, fp16, bf16, e5m2 and e4m3 (8192 tokens, H 2048, 16 experts, top-4), then bf16
with E = 4..8 experts and top-1..5, then zero tokens, and printed the largest difference of every
output and gradient; its gradient differences reached 3.6. This program runs the same cases with
the same functions, imported from ``moe_dispatch.ops.te_v1`` instead of TE, and prints each
comparison three ways:

- "as reported": each side draws its own random upstream gradient, as the report's script does.
  A backward "difference" is then the difference of two random tensors pushed through the ops;
- "shared grad": one upstream gradient for both sides: the difference of the ops themselves;
- "ours vs f64": our result against a float64 oracle, with "1r" where every element is within one
  rounding (one ulp of the output dtype; for fp32 output plus the fp32 sum's own error).

    python examples/te_report.py                  # the report's sizes, on CUDA when present
    python examples/te_report.py --size quick --device cpu

Exit status 1 when one of our forward results or row gradients is not within one rounding of the
float64 oracle.
"""
from __future__ import annotations  # noqa: I001 (the moe_dispatch import stays one line)

import argparse
import sys

import torch

from moe_dispatch.ops.te_v1 import moe_permute as te_permute, moe_unpermute as te_unpermute

SIZES = {"report": (8192, 2048), "quick": (64, 32)}  # (tokens, hidden size)
FP8 = (torch.float8_e5m2, torch.float8_e4m3fn)


def reference_permute(tokens: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch reference: rows in the order of a stable sort of the expert ids."""
    topk = indices.shape[1]
    sorted_indices = torch.argsort(indices.reshape(-1), stable=True)
    return tokens.index_select(0, sorted_indices // topk), sorted_indices


def reference_unpermute(permuted: torch.Tensor, sorted_indices: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """The PyTorch reference: rows back to (token, k) order, each times its prob rounded to the
    rows' dtype, then summed over k in that dtype."""
    T, K = probs.shape
    rows = torch.zeros((T * K, permuted.shape[1]), dtype=permuted.dtype, device=permuted.device)
    rows = rows.index_copy(0, sorted_indices, permuted).view(T, K, permuted.shape[1])
    return (rows * probs[:, :, None]).to(permuted.dtype).sum(1)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` numbers at |x| (float64), subnormals included."""
    fi = torch.finfo(dtype)
    _, exponent = torch.frexp(x.abs().clamp(min=fi.tiny))
    return torch.ldexp(torch.full_like(x, fi.eps / 2), exponent)


def within_one_rounding(ours: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor | None = None,
                        terms: int = 1) -> bool:
    """|ours - exact| <= one ulp of ours' dtype at |exact|, elementwise (a float8 result may also
    saturate at the format's largest value). An fp32 result of a sum of ``terms`` fp32 terms
    (sum of magnitudes ``magnitude``) also carries the fp32 sum's own error, terms * 2^-24 *
    magnitude: for fp32 output the fp32 accumulation is not one rounding."""
    if not ours.numel():
        return True
    top = torch.finfo(ours.dtype).max
    clipped = exact.clamp(-top, top)
    allowed = ulp(clipped, ours.dtype)
    if ours.dtype == torch.float32 and magnitude is not None:
        allowed = allowed + terms * 2.0 ** -24 * magnitude
    return bool(((ours.detach().double() - clipped).abs() <= allowed).all())


def row(label: str, reported: str, shared: str, oracle: str) -> None:
    print(f"{label:<17}{reported:>14}{shared:>14}   {oracle}")


def fmt(diff: float) -> str:
    return "equal" if diff == 0 else f"{diff:.3e}"


def run_case(dtype: torch.dtype, T: int, E: int, H: int, K: int, device: str, gen: torch.Generator) -> bool:
    """One case of the report. Returns True when each of our results is within one rounding."""
    print(f"{dtype} token:{T} hidden_size:{H} expert:{E} topK:{K}")
    row("", "as reported", "shared grad", "ours vs f64")
    # Reference side: fp8 rows run in fp16 holding the same (fp8) values, as the report does.
    ref_dtype = torch.float16 if dtype in FP8 else dtype

    def rand(*shape: int) -> torch.Tensor:  # values exact in both sides' dtypes
        return torch.rand(shape, generator=gen).to(dtype).to(device)

    tokens = rand(T, H)
    if T:
        indices = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(torch.int32).to(device)
    else:
        indices = torch.empty((0, K), dtype=torch.int32, device=device)
    probs = torch.rand((T, K), generator=gen).to(device)
    probs = probs / probs.sum(1, keepdim=True)
    N = T * K

    # Forward passes, and the float64 oracle of the unpermute.
    ref_x = tokens.to(ref_dtype).clone().requires_grad_(True)
    ref_perm, sorted_indices = reference_permute(ref_x, indices)
    our_x = tokens.detach().clone().requires_grad_(True)
    our_perm, row_id_map = te_permute(our_x, indices, N)
    perm_diff = max_diff(ref_perm, our_perm)
    row("[permute fwd]", fmt(perm_diff), fmt(perm_diff), "exact" if torch.equal(
        our_perm.to(ref_dtype), ref_perm) else "DIFFERS")

    ref_y = ref_perm.detach().requires_grad_(True)
    ref_p = probs.clone().requires_grad_(True)
    ref_out = reference_unpermute(ref_y, sorted_indices, ref_p)
    our_y = our_perm.detach().requires_grad_(True)
    our_p = probs.clone().requires_grad_(True)
    our_out = te_unpermute(our_y, row_id_map, our_p)
    y64 = our_perm.detach().double()
    y64 = y64.index_copy(0, sorted_indices, y64) if N else y64
    terms64 = y64.view(T, K, H) * probs.double()[:, :, None]
    exact_out = terms64.sum(1)
    fwd_ok = within_one_rounding(our_out, exact_out, terms64.abs().sum(1), K)

    # Backward passes: the report's own draws, then one shared upstream gradient.
    def backward(out: torch.Tensor, grad: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        for leaf in leaves:
            leaf.grad = None
        out.backward(grad.to(out.dtype), retain_graph=True)
        return [leaf.grad for leaf in leaves]

    (ref_gx_own,) = backward(ref_perm, rand(N, H), [ref_x])
    (our_gx_own,) = backward(our_perm, rand(N, H), [our_x])
    g_perm = rand(N, H)
    (ref_gx,) = backward(ref_perm, g_perm, [ref_x])
    (our_gx,) = backward(our_perm, g_perm, [our_x])
    # the oracle sums permuted row i into token sorted_indices[i] // K, exactly
    gx_exact = torch.zeros((T, H), dtype=torch.float64, device=device).index_add_(
        0, sorted_indices // max(K, 1), g_perm.double())
    gx_mag = torch.zeros_like(gx_exact).index_add_(0, sorted_indices // max(K, 1), g_perm.double().abs())
    gx_ok = within_one_rounding(our_gx, gx_exact, gx_mag, K)
    row("[permute bwd]", fmt(max_diff(ref_gx_own, our_gx_own)), fmt(max_diff(ref_gx, our_gx)),
        f"{max_diff(our_gx, gx_exact):.3e} {'1r' if gx_ok else 'NOT WITHIN ONE ROUNDING'}")

    out_diff = max_diff(ref_out, our_out)
    row("[unpermute fwd]", fmt(out_diff), fmt(out_diff),
        f"{max_diff(our_out, exact_out):.3e} {'1r' if fwd_ok else 'NOT WITHIN ONE ROUNDING'}")

    ref_gy_own, ref_gp_own = backward(ref_out, rand(T, H), [ref_y, ref_p])
    our_gy_own, our_gp_own = backward(our_out, rand(T, H), [our_y, our_p])
    g_out = rand(T, H)
    ref_gy, ref_gp = backward(ref_out, g_out, [ref_y, ref_p])
    our_gy, our_gp = backward(our_out, g_out, [our_y, our_p])
    # d out[t] / d y[row(t, k)] = p[t, k]; d out[t] / d p[t, k] = <y[row(t, k)], g[t]>
    t_of_row = sorted_indices // max(K, 1)
    k_of_row = sorted_indices % max(K, 1)
    gy_exact = g_out.double()[t_of_row] * probs.double()[t_of_row, k_of_row][:, None]
    gy_ok = within_one_rounding(our_gy, gy_exact)
    row("[unpermute bwd]", fmt(max_diff(ref_gy_own, our_gy_own)), fmt(max_diff(ref_gy, our_gy)),
        f"{max_diff(our_gy, gy_exact):.3e} {'1r' if gy_ok else 'NOT WITHIN ONE ROUNDING'}")
    gp_exact = torch.zeros((T, K), dtype=torch.float64, device=device)
    if N:
        gp_exact[t_of_row, k_of_row] = (our_perm.detach().double() * g_out.double()[t_of_row]).sum(1)
    scale = max(float(gp_exact.abs().max()), 1.0) if T else 1.0
    row("[probs bwd]", fmt(max_diff(ref_gp_own, our_gp_own)), fmt(max_diff(ref_gp, our_gp)),
        f"{max_diff(our_gp, gp_exact):.3e} (fp32 dot over H; relative {max_diff(our_gp, gp_exact) / scale:.1e})")
    print()
    return fwd_ok and gx_ok and gy_ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda (the default where present) or cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default="report",
                        help="report: 8192 tokens, H 2048 (the report's); quick: 64 tokens, H 32")
    args = parser.parse_args(argv)
    T, H = SIZES[args.size]
    gen = torch.Generator().manual_seed(1)
    cases = [(dtype, T, 16, H, 4) for dtype in (torch.float32, torch.float16, torch.bfloat16, *FP8)]
    cases += [(torch.bfloat16, T, E, H, E - 3) for E in range(4, 9)]  # E 4..8, top-1..5
    cases += [(torch.bfloat16, 0, 8, H, 5)]  # no tokens
    ok = [run_case(*case, args.device, gen) for case in cases]
    print(f"{sum(ok)} of {len(ok)} cases: every result and row gradient of ours within one rounding of float64")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())

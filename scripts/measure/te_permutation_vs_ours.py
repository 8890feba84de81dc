"""TransformerEngine's permutation functions beside ours (moe_dispatch.ops.te), same inputs.

Run (a CUDA machine with transformer_engine installed; without it the script says so and exits 0):
    python scripts/measure/te_permutation_vs_ours.py [--tokens 4096] [--hidden 4096]

For each case (mask map with probs, index map with and without dropping, permute-and-pad, chunk
sort; fp32 and bf16) one shared input and one shared upstream gradient go through both; the
table gives the largest |TE - ours| of every output and gradient, and for the unpermute forward
each side's largest error against a float64 oracle. Permuted rows and row ids must agree exactly.
"""
from __future__ import annotations

import argparse
import sys

import torch

from moe_dispatch.ops import te as ours


def _diff(a: torch.Tensor | None, b: torch.Tensor | None) -> str:
    if a is None or b is None:
        return "-"
    d = float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0
    return "equal" if d == 0 else f"{d:.2e}"


def _oracle(name: str, rows: torch.Tensor, routing_map: torch.Tensor, indices: torch.Tensor,
            probs: torch.Tensor, num_out: int) -> torch.Tensor:
    """float64 unpermute of ``rows`` (expert-major order) weighted by probs: sum over a token's rows."""
    T, E = routing_map.shape
    if name.startswith("mask"):
        token = torch.arange(T, device=rows.device)[None, :].expand(E, T).masked_select(routing_map.T.contiguous())
        weight = probs.T.contiguous().masked_select(routing_map.T.contiguous())
    else:
        K = indices.shape[1]
        flat = torch.argsort(indices.reshape(-1), stable=True)[:num_out]
        token, weight = flat // K, probs.gather(1, indices.long()).reshape(-1)[flat]
    out = torch.zeros((T, rows.shape[1]), dtype=torch.float64, device=rows.device)
    return out.index_add_(0, token, rows.double() * weight.double()[:, None])


def _run_mask(lib, x, probs, routing_map, go, gperm, pad: bool):
    xl, pl = x.clone().requires_grad_(), probs.clone().requires_grad_()
    if pad:
        counts = routing_map.sum(0)
        out, pp, rmap, pad_offsets, _ = lib.moe_permute_and_pad_with_probs(xl, pl, routing_map, counts, 16)
    else:
        out, pp, rmap = lib.moe_permute_with_probs(xl, pl, routing_map, int(routing_map.sum()))
        pad_offsets = None
    g = gperm[: out.shape[0]]
    y = out.detach().clone().mul_(-1).requires_grad_()  # distinct expert outputs
    ql = probs.clone().requires_grad_()
    res = lib.moe_unpermute(y, rmap, ql, restore_shape=x.shape, pad_offsets=pad_offsets)
    torch.autograd.backward([out, res], [g, go])
    return {"permuted": out, "permuted_probs": pp, "unpermuted": res, "grad_inp": xl.grad,
            "grad_rows": y.grad, "grad_merging_probs": ql.grad, "rows": y.detach()}


def _run_index(lib, x, indices, probs, num_out, go, gperm):
    xl = x.clone().requires_grad_()
    out, rmap = lib.moe_permute(xl, indices, num_out, map_type="index")
    y = out.detach().clone().mul_(-1).requires_grad_()
    ql = probs.clone().requires_grad_()
    res = lib.moe_unpermute(y, rmap, ql, map_type="index")
    torch.autograd.backward([out, res], [gperm[: out.shape[0]], go])
    return {"permuted": out, "row_id_map": rmap, "unpermuted": res, "grad_inp": xl.grad, "grad_rows": y.grad,
            "grad_merging_probs": ql.grad, "rows": y.detach()}


def _run_chunks(lib, x, probs, sizes, order, gperm):
    xl, pl = x.clone().requires_grad_(), probs.clone().requires_grad_()
    out, pp = lib.moe_sort_chunks_by_index_with_probs(xl, pl, sizes, order)
    torch.autograd.backward([out, pp], [gperm[: out.shape[0]], torch.ones_like(pp)])
    return {"sorted": out, "sorted_probs": pp, "grad_inp": xl.grad, "grad_probs": pl.grad}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args(argv)
    try:
        import transformer_engine.pytorch as te_lib
    except Exception as exc:  # not installed, or no CUDA build
        print(f"transformer_engine is not importable ({type(exc).__name__}: {exc}); nothing to compare")
        return 0
    if not torch.cuda.is_available():
        print("TransformerEngine's permutation needs CUDA; nothing to compare")
        return 0
    T, H, dev = args.tokens, args.hidden, "cuda"
    g = torch.Generator(device="cpu").manual_seed(0)
    print(f"{'case':<40}{'output':<20}{'|TE - ours|':>12}   f64 error (TE / ours)")
    for dtype in (torch.float32, torch.bfloat16):
        for E, K in ((7, 2), (16, 5)):
            scores = torch.rand((T, E), generator=g)
            indices = scores.topk(K, 1).indices.to(torch.int32)
            routing_map = torch.zeros((T, E), dtype=torch.bool).scatter_(1, indices.long(), True)
            x = torch.rand((T, H), generator=g).to(dtype).to(dev)
            probs = (torch.softmax(scores, 1) * routing_map).to(dev)
            go = torch.rand((T, H), generator=g).to(dtype).to(dev)
            gperm = torch.rand((T * K + 16 * E, H), generator=g).to(dtype).to(dev)
            rm, ind = routing_map.to(dev), indices.to(dev)
            cases = {
                "mask": lambda lib: _run_mask(lib, x, probs, rm, go, gperm, pad=False),
                "mask, padded to 16": lambda lib: _run_mask(lib, x, probs, rm, go, gperm, pad=True),
                "index": lambda lib: _run_index(lib, x, ind, probs.gather(1, ind.long()), 0, go, gperm),
                "index, dropping": lambda lib: _run_index(lib, x, ind, probs.gather(1, ind.long()),
                                                          T * K - 77, go, gperm),
            }
            for name, fn in cases.items():
                a, b = fn(te_lib), fn(ours)
                for key in a:
                    if key == "rows":
                        continue  # the oracle's input
                    extra = ""
                    if key == "unpermuted" and not name.endswith("padded to 16"):
                        exact = _oracle(name, b["rows"], rm, ind, probs, T * K - 77 if "dropping" in name else T * K)
                        extra = f"   {_diff(a[key], exact)} / {_diff(b[key], exact)}"
                    print(f"{f'{dtype} E{E} K{K} {name}':<40}{key:<20}{_diff(a[key], b[key]):>12}{extra}")
        sizes = torch.tensor([T // 8] * 7 + [T - 7 * (T // 8)], dtype=torch.int32, device=dev)
        order = torch.arange(8, dtype=torch.int32, device=dev).view(2, 4).T.reshape(-1)
        x = torch.rand((T, H), generator=g).to(dtype).to(dev)
        probs = torch.rand(T, generator=g).to(dev)
        gperm = torch.rand((T, H), generator=g).to(dtype).to(dev)
        a = _run_chunks(te_lib, x, probs, sizes, order, gperm)
        b = _run_chunks(ours, x, probs, sizes, order, gperm)
        for key in a:
            print(f"{f'{dtype} chunk sort':<40}{key:<20}{_diff(a[key], b[key]):>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

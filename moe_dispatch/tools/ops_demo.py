"""Ops demo: max error of permute/unpermute against float64, and a repeatability check.

    python -m moe_dispatch.tools.ops_demo [--tokens 4096 --experts 64 --topk 6 --hidden 1024]
"""
from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # loaded after the flags are checked: a bad flag is refused before torch's seconds
    import torch

_START = time.perf_counter()


def _progress(text: str) -> None:
    """A stage as it starts, with the seconds since the command started."""
    print(f"  ... {time.perf_counter() - _START:5.1f} s  {text}", flush=True)


def _error_table(T: int, E: int, K: int, H: int, dtype: torch.dtype, device: str,
                 say: Callable[[str], None] = _progress) -> dict[str, float]:
    import torch

    from ..ops.permutation import permute, unpermute

    name = str(dtype).replace("torch.", "")
    say(f"{name}: routing {T} tokens to {E} experts, top-{K}, and the [T * K, H] expert rows")
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand((T, E), generator=gen)
    routing_map = torch.zeros((T, E), dtype=torch.bool).scatter_(1, scores.topk(K, 1).indices, True)
    probs = torch.softmax(scores, 1) * routing_map
    tokens = torch.randn((T, H), generator=gen).to(dtype)
    rows = torch.randn((T * K, H), generator=gen).to(dtype)  # distinct expert outputs
    upstream = torch.randn((T, H), generator=gen).to(dtype)  # one upstream gradient for everyone

    def ours():
        # Fresh leaves each call (on CPU .to() would alias the inputs and accumulate .grad).
        tok = tokens.to(device, copy=True).requires_grad_()
        pr = probs.to(device, copy=True).requires_grad_()
        y = rows.to(device, copy=True).requires_grad_()
        permuted, _, rmap = permute(tok, routing_map.to(device), pr)
        out = unpermute(y, rmap, pr)
        out.backward(upstream.to(device))
        return tuple(x.detach().cpu().clone() for x in (permuted, out, y.grad, pr.grad))

    say(f"{name}: permute + unpermute, forward and backward")
    permuted, out, grad_rows, grad_probs = ours()
    say(f"{name}: the same again, for the bitwise repeatability")
    again = ours()
    repeatable = all(torch.equal(a, b) for a, b in zip((permuted, out, grad_rows, grad_probs), again))

    # float64 reference on the same inputs and the same upstream gradient.
    say(f"{name}: the float64 reference")
    t_idx, e_idx = routing_map.nonzero(as_tuple=True)  # t-major, e ascending
    order = torch.argsort(e_idx * T + t_idx)  # expert-major rows
    row_of = torch.empty_like(order)
    row_of[order] = torch.arange(len(order))
    p64 = probs.double()[t_idx, e_idx]
    ref_out = torch.zeros((T, H), dtype=torch.float64).index_add_(0, t_idx, p64[:, None] * rows.double()[row_of])
    ref_grad_rows = torch.empty((T * K, H), dtype=torch.float64)
    ref_grad_rows[row_of] = upstream.double()[t_idx] * p64[:, None]
    ref_grad_probs = torch.zeros((T, E), dtype=torch.float64)
    ref_grad_probs[t_idx, e_idx] = (rows.double()[row_of] * upstream.double()[t_idx]).sum(1)
    return {
        "permute (exact copy)": float((permuted.double() - tokens.double()[t_idx[order]]).abs().max()),
        "unpermute fwd": float((out.double() - ref_out).abs().max()),
        "unpermute bwd, rows": float((grad_rows.double() - ref_grad_rows).abs().max()),
        "unpermute bwd, probs": float((grad_probs.double() - ref_grad_probs).abs().max()),
        "repeatable bitwise": float(repeatable),
    }


def validate_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The size flags, checked before torch loads: one ``parser.error`` (exit status 2) naming the flag."""
    for flag in ("tokens", "experts", "topk", "hidden"):
        if getattr(args, flag) < 1:
            parser.error(f"argument --{flag}: must be >= 1, got {getattr(args, flag)}")
    if args.topk > args.experts:
        parser.error(f"argument --topk: {args.topk} exceeds --experts {args.experts}")


def validate_device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--device (imports torch), checked before any work; its default: cuda if CUDA is present, else cpu."""
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        parser.error(f"argument --device: {exc}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"argument --device: expected cpu or cuda, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"argument --device: {args.device!r} needs CUDA, which is not available here")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        parser.error(f"argument --device: {args.device!r}, but this machine has {torch.cuda.device_count()} GPUs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moe-dispatch ops-demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if CUDA is present, else cpu)")
    args = parser.parse_args(argv)
    validate_sizes(parser, args)
    _progress("importing torch (a few seconds)")
    validate_device(parser, args)
    import torch

    print(f"permute/unpermute vs float64: T={args.tokens} E={args.experts} K={args.topk} H={args.hidden} "
          f"on {args.device}", flush=True)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    # The stages print as they start; the table prints whole at the end, not cut by them.
    tables = [_error_table(args.tokens, args.experts, args.topk, args.hidden, dtype, args.device) for dtype in dtypes]
    print(f"{'dtype':>10} | {'pass':<22} | max |ours - float64|")
    ok = True
    for dtype, table in zip(dtypes, tables):
        for name, value in table.items():
            shown = ("yes" if value else "NO") if name == "repeatable bitwise" else f"{value:.3e}"
            print(f"{str(dtype).replace('torch.', ''):>10} | {name:<22} | {shown}")
        ok &= table["repeatable bitwise"] == 1.0 and table["permute (exact copy)"] == 0.0
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

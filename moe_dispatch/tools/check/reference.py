"""The rows against references: our output against the float64 sum of the same expert outputs
(a row that counts: within one final rounding, measured in ulps), and the reference rows (not ours,
never a FAIL) of a reduce-scatter combine, EP 1 against each larger EP size.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from ...config import FP8_FORMATS
from ...dispatcher import Fp8Rows
from ...experts import ExpertRows
from .args import DTYPES
from .contract import Result, bitwise, check_tokens, gather_results, largest_diff, progress


def _ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` numbers in the binade of each float64 value (subnormals: the
    smallest spacing)."""
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(values.abs().clamp_min(info.tiny))
    return torch.ldexp(torch.full_like(values, info.eps), exponent - 1)


REFERENCE_LABEL = "reference, not ours: "
FLOAT64_LABEL = "ours vs float64 sum of the same expert outputs: "

# Under the table when the float64 row is there (report.py), for bf16/fp16 and for fp32 outputs.
FLOAT64_LEGEND = """\
The float64 row: our combine sums a token's p * y terms in one fixed order in {router} and rounds
the sum once to {dtype}. The row takes the {router} sum's own error bound off each output's error
and shows what is left in ulps of {dtype}: that is the final rounding, and rounding to nearest errs
by at most half an ulp, so the bound is 0.50 (a second rounding, or a wrong combine, shows more).
The worst of the {outputs:,} outputs ({tokens} tokens x H={hidden} x {ranks} ranks) prints 0.50 because
among that many roundings one falls a hair from halfway between two {dtype} numbers: just under
half an ulp (0.4999 with the default flags), which two decimals show as the bound itself."""
FLOAT64_LEGEND_FP32 = """\
The float64 row: our combine sums a token's p * y terms in one fixed order in {router} and rounds
once to fp32; the row shows the worst error as a fraction of its bound (half an fp32 ulp for that
rounding plus twice the {router} sum's own error bound), so anything up to 1 passes."""


@torch.no_grad()
def expert_outputs(layer: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [T, E] fp32/fp64, zero where not routed; y [T, E, H] every expert's output for every
    token routed to it, zero elsewhere) for our MoELayer ``layer`` on x [T, H]: its router, and
    all E experts rebuilt on this rank from the same seed (row-stable, so a row's output does not
    depend on which other rows its expert gets)."""
    config = layer.config
    probs, routing_map = layer.router(x)
    experts = type(layer.experts)(config, config.num_experts, 0).to(x.device)
    rows = [routing_map[:, e].nonzero().flatten() for e in range(config.num_experts)]
    counts = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    routed = x[torch.cat(rows)]
    if config.fp8 is None:
        out = experts(routed, counts)
    else:  # the rows as the dispatch delivers them: quantised per token, with their scales
        quantised = Fp8Rows.quantize(routed, FP8_FORMATS[config.fp8])
        sink = torch.zeros((), dtype=x.dtype, device=x.device).expand(routed.shape)
        out = experts(ExpertRows(Fp8Rows(quantised.data, quantised.scales, sink), host_rows_per_expert=counts))
    y = torch.zeros((x.shape[0], config.num_experts, x.shape[1]), dtype=out.dtype, device=x.device)
    for e, (r, block) in enumerate(zip(rows, out.split(counts.tolist()))):
        y[r, e] = block
    return probs, y


def reduce_scatter_combine(probs: torch.Tensor, y: torch.Tensor, ep: int) -> torch.Tensor:
    """probs [T, E], y [T, E, H] -> [T, H] in y's dtype, combined as a reduce-scatter combine does
    at EP size ``ep``: each EP rank sums p * y over its own experts (ascending, in probs' dtype)
    and rounds that partial sum to y's dtype; the ranks' partials are then added in fp32 (in rank
    order) and rounded again. A token whose experts sit on different ranks is rounded twice, so
    its output depends on the EP size. Not ours: a reference that shows what the contract buys."""
    num_experts = probs.shape[1]
    products = probs[:, :, None] * y.to(probs.dtype)
    total = torch.zeros(y.shape[0], y.shape[2], dtype=torch.float32, device=y.device)
    for block in products.split(num_experts // ep, dim=1):
        partial = torch.zeros_like(block[:, 0])
        for e in range(block.shape[1]):  # one term at a time: the fixed ascending order
            partial = partial + block[:, e]
        total = total + partial.to(y.dtype).float()
    return total.to(y.dtype)


def combine_rows(args: argparse.Namespace, device: torch.device, layer: torch.nn.Module,
                 sizes: list[int]) -> list[Result]:
    """Our layer's output against the float64 combine of the same expert outputs (a row that
    counts: within one final rounding), and reference rows (informational, not ours): the same
    expert outputs combined by ``reduce_scatter_combine``, EP 1 against each larger EP size.
    Collective: every rank calls it alike."""
    rank = dist.get_rank()
    progress(rank, "ours vs float64, and the reference combine")
    _, _, own_x = check_tokens(args, device)
    dtype = DTYPES[args.dtype]
    with torch.no_grad():
        ours = layer(own_x).double()
        probs, y = expert_outputs(layer, own_x)
    products = probs.double()[:, :, None] * y.double()
    exact = products.sum(1)
    err = (ours - exact).abs()
    # One final rounding (half a ulp) plus the error of the sum in probs' dtype: K products and
    # K - 1 additions, each within half an ulp of that dtype of sum |p * y|; counted twice, since
    # the final rounding is to the number nearest the computed sum, not the exact one.
    accumulation = torch.finfo(probs.dtype).eps / 2 * (2 * args.topk - 1) * products.abs().sum(1)
    bound = 0.5 * _ulp(exact, dtype) + 2 * accumulation
    within = bool((err <= bound).all())
    # bf16/fp16: the worst error past the fp32 sum's share of the bound, in ulps of the output
    # dtype (at most 1/2: one final rounding). Not the whole error in ulps: where a token's terms
    # cancel to near 0 the ulp is tiny and the fp32 sum's error dominates. fp32: the worst error
    # as a fraction of the bound.
    if dtype == torch.float32:
        worst_of, unit = err / bound, "of the fp32 sum's error bound (bound 1)"
    else:
        worst_of = (err - 2 * accumulation).clamp_min(0) / _ulp(exact, dtype)
        unit = f"ulp of {args.dtype} past the fp32 sum's error (bound 0.50)"
    worst = torch.tensor([float(worst_of.max())], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    measured = f"{float(worst):.2f} {unit}"
    rows = [Result(f"{FLOAT64_LABEL}{measured}", float(err.max()), within)]
    single = reduce_scatter_combine(probs, y, 1)
    for ep in [s for s in sizes if s > 1] or [2]:
        if args.experts % ep:
            continue
        other = reduce_scatter_combine(probs, y, ep)
        rows.append(Result(f"{REFERENCE_LABEL}reduce-scatter combine, EP 1 vs EP {ep}", largest_diff(single, other),
                           bitwise(single, other), informational=True))
    return gather_results(rows, device)

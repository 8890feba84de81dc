"""Train a small megatron-core GPTModel whose MLPs are MoE layers, with our dispatcher and beside
stock Megatron, and check the bitwise claims of training.

Model: megatron-core ``GPTModel`` (2 layers by default, local spec: Megatron's attention and
SequentialMLP experts, no TransformerEngine) whose MoE layers come from
``moe_dispatch.integrations.megatron.deterministic_moe_spec`` (``--stock``: also Megatron's own
spec). Adam (torch) on a fixed synthetic token stream (a seeded random bigram chain), every run
from the same initial weights. Every gradient is scaled by 1 / (data-parallel size) and summed over
its data-parallel group (expert gradients over the expert-data-parallel group), as Megatron's DDP
does.

What it shows, per EP size, for each dispatcher (allgather, alltoall):
- the loss curves (``--svg``: a plain SVG, one panel, a colour per EP size and variant, both
  dispatchers in it) and the largest loss difference between the dispatchers on any rank, per
  step (``--diff-svg``: log scale, ours drawn on its 0 baseline, stock Megatron above it);
- that the loss, every expert weight gradient and every router weight gradient are bitwise
  identical between allgather and alltoall at every step (our dispatcher: a claim that fails
  the run; stock Megatron: shown for comparison);
- with ``--data same`` (every rank reads the same tokens), that every rank reports the same loss.

Where it runs:
    python scripts/train_moe_gpt.py --ep-sizes 1 --stock   # CUDA: one rank per GPU on NCCL
    python scripts/train_moe_gpt.py --share-gpu 2 --ep-sizes 2   # 2 ranks on one GPU, over gloo
megatron-core's MoE code needs CUDA, so this script refuses CPU ranks. The test suite runs it on
CPU gloo ranks (2 by default, EP 1 and 2) through its test-only shims, from a checkout:
    python -m tests.integrations.train_moe_gpt_cpu --stock --svg BENCHMARKS_train_loss.svg
Rank 0 prints a progress line at least every 2 s; the table's legend says which rows are ours.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import tempfile
import time
import warnings
import zlib
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from moe_dispatch.config import DISPATCHER_KINDS
from moe_dispatch.distributed.launch import end_spawned_rank, set_rank_env, spawn_ranks

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ep-sizes", default=None,
                   help="comma-separated (default: 1,2 on CPU; powers of 2 up to the ranks)")
    p.add_argument("--ranks", type=int, default=None, help="default: 2 on CPU, every GPU on CUDA")
    p.add_argument("--share-gpu", type=int, default=0, metavar="N",
                   help="N ranks on GPU 0 over gloo (EP > 1 on one GPU; gloo only moves bytes)")
    p.add_argument("--cpu", action="store_true",
                   help="CPU ranks on gloo even where CUDA is present (test suite's launcher only: see above)")
    p.add_argument("--stock", action="store_true", help="also train stock Megatron (its own dispatchers, same weights)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--aux-loss", type=float, default=1e-2, help="moe_aux_loss_coeff (Megatron's aux_loss)")
    p.add_argument("--data", choices=["split", "same"], default="split",
                   help="split: each rank its own tokens; same: every rank the same tokens")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--svg", default=None,
                   help="write the loss curves to this SVG file (one panel, a colour per EP size and variant)")
    p.add_argument("--diff-svg", default=None,
                   help="write, per step, the largest loss difference between the two dispatchers on any rank "
                        "(ours and, with --stock, stock Megatron) to this SVG file, log scale, 0 drawn")
    p.add_argument("--json", default=None,
                   help="write every run's per-step losses and gradient digests to this JSON file")
    return p


# ---------------------------------------------------------------------------------------------
# Data: a fixed token stream
# ---------------------------------------------------------------------------------------------
def token_stream(vocab: int, length: int, seed: int) -> torch.Tensor:
    """A seeded bigram chain [length] int64: each token has 4 successors with fixed probabilities,
    so a model can learn it (the loss falls towards the chain's entropy)."""
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 4), generator=gen)
    weights = torch.tensor([0.55, 0.25, 0.15, 0.05])
    choice = torch.multinomial(weights, length, replacement=True, generator=gen)
    out = torch.empty(length, dtype=torch.int64)
    out[0] = 0
    for i in range(1, length):
        out[i] = successors[out[i - 1], choice[i]]
    return out


def batch_at(stream: torch.Tensor, step: int, rank: int, args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """(tokens [B, S], labels [B, S]) of one rank at one step; a fixed slice of the stream."""
    source = 0 if args.data == "same" else rank
    span = args.seq + 1
    starts = [((step * args.world + source) * args.batch + b) * span for b in range(args.batch)]
    rows = torch.stack([stream[s % (len(stream) - span):][:span] for s in starts])
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


# ---------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------
def transformer_config(args: argparse.Namespace, kind: str, ep: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = DTYPES[args.dtype]
    return TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn, moe_ffn_hidden_size=args.ffn, num_moe_experts=args.experts,
        moe_router_topk=args.topk, moe_token_dispatcher_type=kind, moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=args.aux_loss,
        add_bias_linear=False, use_cpu_initialization=True, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, expert_model_parallel_size=ep)


def build_model(args: argparse.Namespace, kind: str, ep: int, stock: bool, device: torch.device):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from moe_dispatch.integrations.megatron import deterministic_moe_spec

    spec = get_gpt_layer_local_spec(num_experts=args.experts)
    if not stock:
        spec = deterministic_moe_spec(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformer_config(args, kind, ep)
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab,
                         max_sequence_length=args.seq)
        if config.bf16:  # as Megatron's training loop does: bf16 weights and activations, fp32 loss
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(config, model)
    return model.to(device).train()


@torch.no_grad()
def seed_weights(model, seed: int) -> None:
    """Weights that depend only on the seed and the parameter, never on the EP size: each MoE
    layer's router and experts by global expert id (``load_seeded_weights``), every other matrix
    normal(0, 0.02) from its own generator (seeded by its name); norms and biases as built."""
    from moe_dispatch.integrations.megatron.build import load_seeded_weights

    moe = [m for m in model.modules() if hasattr(m, "router") and hasattr(m, "local_expert_indices")]
    for i, layer in enumerate(moe):
        load_seeded_weights(layer, seed + 7919 * (i + 1))
    in_moe = {id(p) for layer in moe for p in layer.parameters()}
    for name, p in model.named_parameters():
        if p.dim() >= 2 and id(p) not in in_moe:
            gen = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
            p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen))


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()[:20]


def _grad_digests(model) -> dict:
    """{name: sha of the gradient} for every expert weight (by global expert id) and router weight."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "router") and hasattr(module, "local_expert_indices"):
            out[f"{name}.router"] = _digest(module.router.weight.grad)
            for i, expert in enumerate(module.experts.local_experts):
                e = module.local_expert_indices[i]
                out[f"{name}.expert{e}.fc1"] = _digest(expert.linear_fc1.weight.grad)
                out[f"{name}.expert{e}.fc2"] = _digest(expert.linear_fc2.weight.grad)
    return out


def _sync_grads(model) -> None:
    """Gradients as Megatron's DDP makes them: every gradient scaled by 1 / (data-parallel size),
    since each rank's loss is the mean over its own tokens, then summed over the data-parallel
    group (dense parameters) or the expert-data-parallel group (expert parameters,
    ``allreduce=False``: at EP > 1 an expert's gradient already sums the tokens of every EP rank)."""
    from megatron.core import parallel_state

    dense = parallel_state.get_data_parallel_group()
    expert = parallel_state.get_expert_data_parallel_group()
    scale = 1.0 / dist.get_world_size(dense)
    for p in model.parameters():
        if p.grad is None:
            continue
        group = dense if getattr(p, "allreduce", True) else expert
        p.grad.mul_(scale)
        if dist.get_world_size(group) > 1:
            dist.all_reduce(p.grad, group=group)


WARMUP_STEPS = 3  # steps left out of the median step time
PROGRESS_SECONDS = 2.0  # rank 0 prints a progress line at least this often (and at the first and last step)


def train(args: argparse.Namespace, model, device: torch.device, stream: torch.Tensor, name: str = "") -> dict:
    rank = dist.get_rank()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    mask = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool, device=device), 1)[None, None]
    positions = torch.arange(args.seq, device=device)[None].expand(args.batch, -1)
    losses, mean_losses, grads, step_seconds = [], [], [], []
    start = last_print = time.perf_counter()
    for step in range(args.steps):
        step_start = time.perf_counter()
        tokens, labels = (t.to(device) for t in batch_at(stream, step, rank, args))
        opt.zero_grad(set_to_none=True)
        per_token = model(tokens, positions, mask, labels=labels)  # [B, S] fp32
        loss = per_token.float().mean()
        loss.backward()
        _sync_grads(model)
        if device.type == "cuda":
            torch.cuda.synchronize()  # the digests below copy every gradient to the host: not timed
        digest_start = time.perf_counter()
        grads.append(_grad_digests(model))
        digest_seconds = time.perf_counter() - digest_start
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(loss.item())
        mean_losses.append(mean.item() / dist.get_world_size())  # .item() waits for the step's GPU work
        now = time.perf_counter()
        step_seconds.append(now - step_start - digest_seconds)
        if rank == 0 and (step in (0, args.steps - 1) or now - last_print >= PROGRESS_SECONDS):
            print(f"  ... {now - args.t0:6.1f} s  {name}: step {step + 1}/{args.steps}, loss {mean_losses[-1]:.4f}",
                  flush=True)
            last_print = now
    seconds = time.perf_counter() - start
    # A step's cost without its gradient digests: the median after the first steps, which autotune
    # Triton kernels and warm the allocator.
    steady = sorted(step_seconds[WARMUP_STEPS:] or step_seconds)
    dispatchers = sorted({_dispatcher_name(m) for m in model.modules() if hasattr(m, "token_dispatcher")})
    return dict(losses=losses, mean_losses=mean_losses, grads=grads, seconds=seconds,
                step_seconds=steady[len(steady) // 2], dispatchers=dispatchers)


def _dispatcher_name(moe_layer) -> str:
    """The class of the layer's dispatcher: ours inside its Megatron wrapper, or Megatron's own."""
    from moe_dispatch.integrations.megatron import is_installed

    ours = is_installed(moe_layer)
    return type(moe_layer.token_dispatcher.dispatcher if ours else moe_layer.token_dispatcher).__name__


def rank_main(local_rank: int, world: int, port: int, ep: int, args: argparse.Namespace, out_dir: str) -> None:
    """One spawned rank: train every run at EP ``ep``, write its results to ``out_dir``."""
    set_rank_env(local_rank, world, port)
    warnings.filterwarnings("ignore")
    # megatron-core <= 0.17 logs "Unknown MLP type" for every layer built from our spec (README).
    logging.getLogger("megatron.core.transformer.transformer_layer").setLevel(logging.ERROR)
    args.world = world
    if args.backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    elif args.share_gpu:
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    else:  # CPU ranks: only with the test suite's shims applied (see the module docstring)
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group(args.backend, device_id=device if args.backend == "nccl" else None)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from moe_dispatch.integrations.megatron.build import prepare_megatron

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    prepare_megatron(device)
    stream = token_stream(args.vocab, 1 << 16, args.seed)
    runs = {}
    for stock in ((False, True) if args.stock else (False,)):
        for kind in DISPATCHER_KINDS:
            torch.manual_seed(args.seed)
            model_parallel_cuda_manual_seed(args.seed)
            model = build_model(args, kind, ep, stock, device)
            seed_weights(model, args.seed)  # every run, at every EP size, starts from the same weights
            name = f"{'stock' if stock else 'ours'}-{kind}"
            runs[name] = train(args, model, device, stream, name=f"EP {ep} {name}")
    with open(os.path.join(out_dir, f"ep{ep}-rank{dist.get_rank()}.json"), "w") as f:
        json.dump(runs, f)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    end_spawned_rank()


# ---------------------------------------------------------------------------------------------
# Claims and the plot
# ---------------------------------------------------------------------------------------------
def _first_difference(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), -1)


def claims(ep: int, ranks: list[dict], data: str) -> list[tuple[str, bool, str, bool]]:
    """(claim, holds, detail, counts) rows for one EP size; counts=False rows are stock references."""
    rows = []
    for variant in ("ours", "stock"):
        ag, a2a = f"{variant}-allgather", f"{variant}-alltoall"
        if ag not in ranks[0]:
            continue
        counts = variant == "ours"
        label = f"EP {ep} {'moe-dispatch' if counts else 'stock Megatron'}"
        step = max(_first_difference(r[ag]["losses"], r[a2a]["losses"]) for r in ranks)
        rows.append((f"{label}: loss bitwise, allgather vs alltoall (every rank, every step)", step < 0,
                     "" if step < 0 else f"first differs at step {step}", counts))
        for what in ("expert", "router"):
            total = differ = 0
            for r in ranks:
                for g1, g2 in zip(r[ag]["grads"], r[a2a]["grads"]):
                    for key in g1:
                        if (".expert" in key) == (what == "expert"):
                            total += 1
                            differ += g1[key] != g2[key]
            rows.append((f"{label}: {what} weight grads bitwise, allgather vs alltoall", differ == 0,
                         f"{total - differ}/{total} tensors x steps equal", counts))
        if data == "same":
            for kind in (ag, a2a):
                same = all(r[kind]["losses"] == ranks[0][kind]["losses"] for r in ranks)
                rows.append((f"{label}: identical data -> identical loss on every rank ({kind.split('-')[1]})",
                             same, "", counts))
    return rows


def ep_claims(by_ep: dict) -> list[tuple[str, bool, str, bool]]:
    """Across EP sizes (same weights, same tokens on each rank): the step-0 loss is the forward
    contract (bitwise for ours); later steps also need the expert weight gradients, whose sum
    over tokens is split differently (see the README), so they are shown, not claimed."""
    rows = []
    sizes = sorted(by_ep)
    for variant, counts in (("ours", True), ("stock", False)):
        for ep in sizes[1:]:
            first, other = by_ep[sizes[0]], by_ep[ep]
            for kind in DISPATCHER_KINDS:
                name = f"{variant}-{kind}"
                if name not in first[0]:
                    continue
                label = f"EP {sizes[0]} vs EP {ep} {'moe-dispatch' if counts else 'stock Megatron'} ({kind})"
                same0 = all(a[name]["losses"][0] == b[name]["losses"][0] for a, b in zip(first, other))
                rows.append((f"{label}: step-0 loss bitwise on every rank", same0, "", counts))
                for what, counted in (("router", counts), ("expert", False)):
                    total = equal = 0
                    for a, b in zip(first, other):
                        g1, g2 = a[name]["grads"][0], b[name]["grads"][0]
                        for key in set(g1) & set(g2):
                            if (".expert" in key) == (what == "expert"):
                                total += 1
                                equal += g1[key] == g2[key]
                    rows.append((f"{label}: step-0 {what} weight grads bitwise", equal == total,
                                 f"{equal}/{total} tensors equal", counted))
                step = max(_first_difference(a[name]["losses"], b[name]["losses"]) for a, b in zip(first, other))
                rows.append((f"{label}: loss bitwise at every step", step < 0,
                             "" if step < 0 else f"first differs at step {step} (expert grads summed per rank)",
                             False))
    return rows


TABLE_LEGEND = """\
PASS / FAIL: a claim of ours (moe-dispatch); a FAIL fails the run. DIFF (reference): stock
Megatron, trained beside ours from the same weights on the same tokens, shown for comparison; it
is expected to differ and never fails the run. DIFF (not claimed): ours across EP sizes after
step 0, where each EP size sums an expert's weight gradient over its tokens in its own order."""


def row_status(claim: str, holds: bool, counts: bool) -> str:
    """PASS / FAIL for a counted claim; for a row shown but not claimed, which kind it is."""
    if holds:
        return "PASS"
    if counts:
        return "FAIL"
    return "DIFF (reference)" if "stock Megatron" in claim else "DIFF (not claimed)"


def dispatcher_differences(dump: dict) -> dict:
    """{"EP e ours" / "EP e stock Megatron": [max over ranks of |loss(allgather) - loss(alltoall)|
    per step]} from main's dump (each rank's own loss: every rank is compared)."""
    out = {}
    for key, run in dump.items():
        ep, name = key.split(" ", 2)[1], key.split(" ", 2)[2]
        variant, kind = name.split("-", 1)
        other = dump.get(f"EP {ep} {variant}-{DISPATCHER_KINDS[1]}")
        if kind != DISPATCHER_KINDS[0] or other is None:
            continue
        label = f"EP {ep} {'moe-dispatch' if variant == 'ours' else 'stock Megatron'}"
        out[label] = [max(abs(a - b) for a, b in zip(ranks_a, ranks_b))
                      for ranks_a, ranks_b in zip(zip(*run["rank_losses"]), zip(*other["rank_losses"]))]
    return out


def write_diff_svg(path: str, series: dict, title: str) -> None:
    """A plain SVG of {label: [difference per step]} on a log y axis, where 0 (bitwise equal) is
    drawn on its own baseline under the lowest decade, so that a run at 0 shows as a visible line
    with markers rather than vanishing off a log scale. The legend is as wide as its longest entry;
    the title wraps to the drawing's width."""
    import math

    import svg_plot

    left = 24 + svg_plot.text_width("0 (bitwise)") + 10  # the axis title, then the widest tick label
    pw, ph, bottom = 430, 341, 45
    notes = {label: "0 at every step" if all(v == 0 for v in ys) else f"max {max(ys):.2g}"
             for label, ys in series.items()}
    entries = [f"{label} ({note})" for label, note in notes.items()]
    width = left + pw + 12 + 34 + max(svg_plot.text_width(e) for e in entries) + 10
    titles = svg_plot.wrap(title, width - 20, 14)
    top = 34 + 18 * (len(titles) - 1)
    height = top + ph + bottom
    positive = [v for ys in series.values() for v in ys if v > 0]
    lo = math.floor(math.log10(min(positive))) if positive else -8
    hi = math.ceil(math.log10(max(positive))) if positive else -7
    hi = max(hi, lo + 1)
    steps = max(len(ys) for ys in series.values())
    zero_y = top + ph - 8  # the 0 baseline; decades lo..hi above it
    decade_h = (ph - 40) / (hi - lo)

    def y_of(v: float) -> float:
        return zero_y if v <= 0 else zero_y - 28 - (math.log10(v) - lo) * decade_h

    def x_of(i: int) -> float:
        return left + pw * i / max(1, steps - 1)

    out = [*svg_plot.header(width, height), svg_plot.metadata("train_moe_gpt:write_diff_svg", series=series,
                                                               title=title)]
    out += [svg_plot.text(10, 20 + 18 * n, line, font_size=14) for n, line in enumerate(titles)]
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>')
    for e in range(lo, hi + 1):
        y = y_of(10.0 ** e)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#ddd"/>'
                   + svg_plot.text(left - 6, y + 4, f"1e{e}", text_anchor="end"))
    brk = zero_y - 14  # the axis break between the 0 baseline and the lowest decade
    out.append(f'<line x1="{left}" y1="{brk:.1f}" x2="{left + pw}" y2="{brk:.1f}" stroke="#888" '
               'stroke-dasharray="2,3"/>' + svg_plot.text(left - 6, zero_y + 4, "0 (bitwise)", text_anchor="end"))
    for k in range(6):
        i = round((steps - 1) * k / 5)
        out.append(svg_plot.text(x_of(i), top + ph + 18, str(i), text_anchor="middle"))
    out.append(svg_plot.text(left + pw / 2, height - 8, "step", text_anchor="middle"))
    mid = top + ph / 2
    out.append(svg_plot.text(16, mid, "max |loss difference| over ranks (log)", text_anchor="middle",
                             transform=f"rotate(-90 16 {mid})"))
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]
    for n, ((label, ys), entry) in enumerate(zip(series.items(), entries)):
        color = colors[n % len(colors)]
        zero = all(v == 0 for v in ys)
        points = " ".join(f"{x_of(i):.1f},{y_of(v):.1f}" for i, v in enumerate(ys))
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="{3 if zero else 1.5}" points="{points}"/>')
        for i, v in enumerate(ys):
            out.append(f'<circle cx="{x_of(i):.1f}" cy="{y_of(v):.1f}" r="2.5" fill="{color}"/>')
        lx, ly = left + pw + 12, top + 18 * n + 8
        out.append(f'<line x1="{lx}" y1="{ly}" x2="{lx + 28}" y2="{ly}" stroke="{color}" stroke-width="3"/>'
                   + svg_plot.text(lx + 34, ly + 4, entry))
    svg_plot.write(path, out)


def write_svg(path: str, series: dict, title: str) -> None:
    """A plain SVG of {"EP e variant-kind": [loss per step]} in one panel: a colour and a dash per
    (EP size, variant), its two dispatchers drawn in it (allgather wide and pale, alltoall narrow
    over it), and a legend entry per colour saying whether its two curves are bitwise equal and
    where they end."""
    import svg_plot

    groups: dict[str, dict[str, list]] = {}
    for key, ys in series.items():
        group, _, kind = key.rpartition("-")
        groups.setdefault(group, {})[kind] = ys
    entries = {}
    for group, curves in groups.items():
        name = group.replace("ours", "moe-dispatch").replace("stock", "stock Megatron")
        same = len({tuple(ys) for ys in curves.values()}) == 1
        last = " / ".join(f"{ys[-1]:.3f}" for ys in list(curves.values())[:1 if same else None])
        entries[group] = (f"{name}: {'dispatchers bitwise equal' if same else 'dispatchers differ'}; "
                          f"step {len(next(iter(curves.values()))) - 1}: {last}")
    kinds = {DISPATCHER_KINDS[0]: f"{DISPATCHER_KINDS[0]} (wide, pale)",
             DISPATCHER_KINDS[1]: f"{DISPATCHER_KINDS[1]} (narrow, over it)"}
    left, pw, ph, bottom = 60, 480, 300, 45
    legend_w = 12 + 34 + max(svg_plot.text_width(e) for e in [*entries.values(), *kinds.values()]) + 10
    width = left + pw + legend_w
    titles = svg_plot.wrap(title, width - 20, 14)
    top = 34 + 18 * (len(titles) - 1)
    height = top + ph + bottom
    values = [v for ys in series.values() for v in ys]
    pad = (max(values) - min(values)) * 0.03 or 0.5
    lo, hi = min(values) - pad, max(values) + pad
    steps = max(len(ys) for ys in series.values())

    def x_of(i: int) -> float:
        return left + pw * i / max(1, steps - 1)

    def y_of(v: float) -> float:
        return top + ph * (hi - v) / (hi - lo)

    out = [*svg_plot.header(width, height), svg_plot.metadata("train_moe_gpt:write_svg", series=series, title=title)]
    out += [svg_plot.text(10, 20 + 18 * n, line, font_size=14) for n, line in enumerate(titles)]
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>')
    for v in svg_plot.nice_ticks(lo, hi):
        out.append(f'<line x1="{left}" y1="{y_of(v):.1f}" x2="{left + pw}" y2="{y_of(v):.1f}" stroke="#eee"/>'
                   + svg_plot.text(left - 6, y_of(v) + 4, f"{v:g}", text_anchor="end"))
    for i in svg_plot.nice_ticks(0, steps - 1):
        out.append(svg_plot.text(x_of(i), top + ph + 16, f"{i:g}", text_anchor="middle"))
    out.append(svg_plot.text(left + pw / 2, height - 8, "step", text_anchor="middle"))
    mid = top + ph / 2
    out.append(svg_plot.text(16, mid, "loss (mean over ranks)", text_anchor="middle",
                             transform=f"rotate(-90 16 {mid})"))
    # A colour and a dash per (EP size, variant), so that curves drawn over each other stay apart;
    # allgather wide and pale, alltoall narrow over it (one narrow line inside a wide one: equal).
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    dashes = ["", ' stroke-dasharray="9,4"', ' stroke-dasharray="3,3"', ' stroke-dasharray="12,3,3,3"']
    widths = {DISPATCHER_KINDS[0]: ' stroke-width="4" stroke-opacity="0.35"',
              DISPATCHER_KINDS[1]: ' stroke-width="1.5"'}
    lx = left + pw + 12
    for n, (group, curves) in enumerate(groups.items()):
        color, dash = colors[n % len(colors)], dashes[n % len(dashes)]
        for kind, ys in curves.items():
            points = " ".join(f"{x_of(i):.1f},{y_of(v):.1f}" for i, v in enumerate(ys))
            out.append(f'<polyline fill="none" stroke="{color}"{widths.get(kind, widths[DISPATCHER_KINDS[1]])}{dash} '
                       f'points="{points}"/>')
        ly = top + 8 + 18 * n
        out.append(f'<line x1="{lx}" y1="{ly}" x2="{lx + 28}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/>'
                   + svg_plot.text(lx + 34, ly + 4, entries[group]))
    for n, (kind, stroke) in enumerate(widths.items()):
        ly = top + 8 + 18 * (len(groups) + 1 + n)
        out.append(f'<line x1="{lx}" y1="{ly}" x2="{lx + 28}" y2="{ly}" stroke="#444"{stroke}/>'
                   + svg_plot.text(lx + 34, ly + 4, kinds[kind]))
    svg_plot.write(path, out)


def main(argv: list[str] | None = None, rank_fn: Callable = rank_main) -> int:
    """The run; ``rank_fn`` (``rank_main`` or a wrapper of it with the same arguments) runs each
    spawned rank."""
    args = build_parser().parse_args(argv)
    args.t0 = time.perf_counter()  # progress lines show the time since the start (spawned ranks get a copy)
    cuda = torch.cuda.is_available() and not args.cpu
    if args.share_gpu and not cuda:
        raise SystemExit("--share-gpu needs CUDA")
    if not cuda and rank_fn is rank_main:
        raise SystemExit("train_moe_gpt: megatron-core's MoE code needs CUDA; CPU ranks run only through the test "
                         "suite's shims: python -m tests.integrations.train_moe_gpt_cpu [flags]")
    args.backend = "nccl" if cuda and not args.share_gpu else "gloo"
    world = args.share_gpu or args.ranks or (torch.cuda.device_count() if cuda else 2)
    if args.ep_sizes:
        sizes = [int(s) for s in args.ep_sizes.split(",")]
    else:
        sizes = [s for s in (1, 2, 4, 8) if s <= world and world % s == 0 and args.experts % s == 0]
    for s in sizes:
        if s < 1 or world % s or args.experts % s:
            raise SystemExit(f"--ep-sizes: {s} must divide the ranks ({world}) and --experts ({args.experts})")
    if not cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU shims refuse a process that sees a GPU
    where = f"{world} ranks, {args.backend}, " + ("GPU 0 shared" if args.share_gpu else "CUDA" if cuda else "CPU")
    print(f"train_moe_gpt: GPTModel {args.layers} layers, H {args.hidden}, E {args.experts}, K {args.topk}, "
          f"{args.dtype}, {args.batch}x{args.seq} tokens per rank per step, {args.steps} steps, Adam lr {args.lr}, "
          f"data {args.data}; {where}", flush=True)
    rows, series, dump, by_ep = [], {}, {}, {}
    with tempfile.TemporaryDirectory() as out_dir:
        for ep in sizes:
            print(f"  ... {time.perf_counter() - args.t0:6.1f} s  EP {ep}: starting {world} ranks (each imports "
                  "megatron-core and builds its models: seconds before the first step)", flush=True)
            if spawn_ranks(rank_fn, world, ep, args, out_dir, name="train_moe_gpt"):
                return 1
            ranks = [json.loads(Path(out_dir, f"ep{ep}-rank{r}.json").read_text()) for r in range(world)]
            rows += claims(ep, ranks, args.data)
            by_ep[ep] = ranks
            for name, run in ranks[0].items():
                series[f"EP {ep} {name}"] = run["mean_losses"]
                dump[f"EP {ep} {name}"] = dict(mean_losses=run["mean_losses"],
                                               rank_losses=[r[name]["losses"] for r in ranks],
                                               rank_grads=[r[name]["grads"] for r in ranks],
                                               dispatchers=run["dispatchers"],
                                               seconds=max(r[name]["seconds"] for r in ranks),
                                               step_seconds=max(r[name]["step_seconds"] for r in ranks))
    rows += ep_claims(by_ep)
    last = f"loss step {args.steps - 1}"
    print(f"\n{'run':<28} | loss step 0 | {last} | s per step (median of steps {WARMUP_STEPS}+, "
          "gradient digests not counted)")
    for name, run in dump.items():
        print(f"{name:<28} | {run['mean_losses'][0]:>11.5f} | {run['mean_losses'][-1]:>{len(last)}.5f} | "
              f"{run['step_seconds']:.4f}")
    print("\n" + TABLE_LEGEND)
    width = max(len(r[0]) for r in rows)
    print(f"{'claim':<{width}} | {'result':<16} | detail")
    failed = 0
    for claim, holds, detail, counts in rows:
        failed += counts and not holds
        print(f"{claim:<{width}} | {row_status(claim, holds, counts):<16} | {detail}")
    if args.svg:
        write_svg(args.svg, series, f"GPTModel {args.layers}x MoE (E {args.experts}, K {args.topk}), {args.dtype}, "
                                    f"{where}")
        print(f"wrote {args.svg}")
    if args.diff_svg:
        write_diff_svg(args.diff_svg, dispatcher_differences(dump),
                       f"allgather vs alltoall: loss difference per step; GPTModel {args.layers}x MoE "
                       f"(E {args.experts}, K {args.topk}), {args.dtype}, {where}")
        print(f"wrote {args.diff_svg}")
    if args.json:
        Path(args.json).write_text(json.dumps(dump, indent=1) + "\n")
    print("ALL PASS" if not failed else f"{failed} FAIL", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

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

FP8 (``--fp8 e4m3``): our layers run our per-token FP8 (``deterministic_moe_spec(spec, fp8=...)``:
each token's row quantised once before the dispatch, both expert GEMMs in FP8), and the claims
above are made of those runs. ``--compare-fp8`` trains every seed (``--seeds``) twice, without and
with FP8, from the same weights on the same tokens, and prints per seed the mean loss over the last
20 steps of both and the gap (``--fp8-svg``: both runs' loss curves for every seed in one panel).
``--no-fp8-wgrad`` (Megatron's flag) runs the FP8 layers' expert weight gradients in the tokens' dtype.

Where it runs:
    python scripts/train_moe_gpt.py --ep-sizes 1 --stock   # CUDA: one rank per GPU on NCCL
    python scripts/train_moe_gpt.py --share-gpu 2 --ep-sizes 2   # 2 ranks on one GPU, over gloo
    python scripts/train_moe_gpt.py --ep-sizes 1 --steps 100 --seeds 1,2,3 --compare-fp8 --fp8-svg fp8.svg
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

from moe_dispatch.config import DISPATCHER_KINDS, FP8_FORMATS
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
    p.add_argument("--seeds", default=None,
                   help="comma-separated seeds, each its own initial weights and token stream (default: --seed)")
    p.add_argument("--fp8", choices=sorted(FP8_FORMATS), default=None,
                   help="our layers with our per-token FP8 dispatch and expert GEMMs (not with --stock)")
    p.add_argument("--compare-fp8", action="store_true",
                   help="train every seed without and with FP8 (--fp8, default e4m3) and print the loss gap "
                        f"over the last {LAST_STEPS} steps")
    p.add_argument("--no-fp8-wgrad", action="store_true",
                   help="with --fp8 or --compare-fp8: the FP8 runs' expert weight gradients in the tokens' dtype "
                        "(Megatron's own flag: TransformerConfig.fp8_wgrad=False)")
    p.add_argument("--fp8-svg", default=None,
                   help="with --compare-fp8: write both runs' loss curves for every seed to this SVG file")
    p.add_argument("--svg", default=None,
                   help="write the loss curves to this SVG file (one panel, a colour per EP size and variant)")
    p.add_argument("--diff-svg", default=None,
                   help="write, per step, the largest loss difference between the two dispatchers on any rank "
                        "(ours and, with --stock, stock Megatron) to this SVG file, log scale, 0 drawn")
    p.add_argument("--json", default=None,
                   help="write every run's per-step losses and gradient digests to this JSON file (with "
                        "--compare-fp8 also the table's numbers, under the key 'fp8_comparison')")
    return p


LAST_STEPS = 20  # --compare-fp8: the loss is averaged over this many last steps


def check_args(args: argparse.Namespace, cuda: bool) -> None:
    """Parse --seeds into ``args.seed_list`` and ``args.fp8_formats`` (the fp8 values each seed
    trains with); SystemExit naming the flag for a combination the script cannot run."""
    try:
        seeds = [int(v) for v in args.seeds.split(",")] if args.seeds is not None else [args.seed]
    except ValueError:
        raise SystemExit(f"--seeds: expected comma-separated integers, got {args.seeds!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise SystemExit(f"--seeds: expected distinct seeds, got {args.seeds!r}")
    args.seed_list = seeds
    args.fp8_formats = [None, args.fp8 or "e4m3"] if args.compare_fp8 else [args.fp8]
    uses_fp8 = args.fp8_formats != [None]
    if uses_fp8 and args.stock:
        raise SystemExit(f"--{'compare-fp8' if args.compare_fp8 else 'fp8'} with --stock: stock Megatron has no "
                         "per-token FP8 (its FP8 is TransformerEngine's), so FP8 runs are ours only; drop --stock")
    if args.no_fp8_wgrad and not uses_fp8:
        raise SystemExit("--no-fp8-wgrad sets where the FP8 runs' weight gradients run: add --fp8 or --compare-fp8")
    if args.fp8_svg and not args.compare_fp8:
        raise SystemExit("--fp8-svg draws the --compare-fp8 runs: add --compare-fp8")
    if uses_fp8 and (args.hidden % 16 or args.ffn % 16):
        raise SystemExit(f"--fp8: --hidden and --ffn must be multiples of 16 (FP8 GEMM rows of 16 bytes), got "
                         f"{args.hidden} and {args.ffn}")
    if uses_fp8 and cuda and args.dtype != "bf16":
        raise SystemExit(f"--fp8 on CUDA needs --dtype bf16 (the FP8 expert GEMM's only output), got {args.dtype}")


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
        params_dtype=dtype, bf16=dtype == torch.bfloat16, expert_model_parallel_size=ep,
        fp8_wgrad=not args.no_fp8_wgrad)


def build_model(args: argparse.Namespace, kind: str, ep: int, stock: bool, device: torch.device,
                fp8: str | None = None):
    """The GPTModel with stock Megatron's MoE layers, or ours (with ``fp8``: our per-token FP8)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from moe_dispatch.integrations.megatron import deterministic_moe_spec

    spec = get_gpt_layer_local_spec(num_experts=args.experts)
    if not stock:
        spec = deterministic_moe_spec(spec, fp8=fp8)
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
    runs = {}
    for seed in args.seed_list:
        stream = token_stream(args.vocab, 1 << 16, seed)
        for stock, fp8 in [*((False, f) for f in args.fp8_formats), *([(True, None)] if args.stock else [])]:
            variant = variant_name(stock, fp8, seed if len(args.seed_list) > 1 else None)
            for kind in DISPATCHER_KINDS:
                torch.manual_seed(seed)
                model_parallel_cuda_manual_seed(seed)
                model = build_model(args, kind, ep, stock, device, fp8)
                seed_weights(model, seed)  # every run of a seed, at every EP size, starts from the same weights
                name = f"{variant}-{kind}"
                runs[name] = dict(train(args, model, device, stream, name=f"EP {ep} {name}"),
                                  variant=variant, kind=kind, seed=seed, fp8=fp8, stock=stock)
    with open(os.path.join(out_dir, f"ep{ep}-rank{dist.get_rank()}.json"), "w") as f:
        json.dump(runs, f)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    end_spawned_rank()


def variant_name(stock: bool, fp8: str | None, seed: int | None) -> str:
    """A run's name less its dispatcher: 'ours' or 'stock', then 'FP8 <format>' and 'seed <s>' where
    they apply (no '-': the dispatcher follows the last one)."""
    return " ".join(["stock" if stock else "ours", *([f"FP8 {fp8}"] if fp8 else []),
                     *([f"seed {seed}"] if seed is not None else [])])


# ---------------------------------------------------------------------------------------------
# Claims and the plot
# ---------------------------------------------------------------------------------------------
def describe(variant: str) -> str:
    """A variant as the table and the plots name it: 'moe-dispatch ...' or 'stock Megatron ...'."""
    first, _, rest = variant.partition(" ")
    return " ".join([{"ours": "moe-dispatch", "stock": "stock Megatron"}.get(first, first), *([rest] if rest else [])])


def _variants(runs: dict) -> list[str]:
    """The variants of one rank's runs ({"<variant>-<kind>": run}), in the order they ran."""
    return list(dict.fromkeys(name.rpartition("-")[0] for name in runs))


def _first_difference(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), -1)


def claims(ep: int, ranks: list[dict], data: str) -> list[tuple[str, bool, str, bool]]:
    """(claim, holds, detail, counts) rows for one EP size; counts=False rows are stock references."""
    rows = []
    for variant in _variants(ranks[0]):
        ag, a2a = f"{variant}-allgather", f"{variant}-alltoall"
        if ag not in ranks[0] or a2a not in ranks[0]:
            continue
        counts = not variant.startswith("stock")
        label = f"EP {ep} {describe(variant)}"
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
    for variant in _variants(by_ep[sizes[0]][0]):
        counts = not variant.startswith("stock")
        for ep in sizes[1:]:
            first, other = by_ep[sizes[0]], by_ep[ep]
            for kind in DISPATCHER_KINDS:
                name = f"{variant}-{kind}"
                if name not in first[0]:
                    continue
                label = f"EP {sizes[0]} vs EP {ep} {describe(variant)} ({kind})"
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
        variant, _, kind = name.rpartition("-")
        other = dump.get(f"EP {ep} {variant}-{DISPATCHER_KINDS[1]}")
        if kind != DISPATCHER_KINDS[0] or other is None:
            continue
        label = f"EP {ep} {describe(variant)}"
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


def _loss_frame(svg_plot, series: dict, title: str, legend_width: float, body_height: float,
                meta: str) -> tuple[list, dict]:
    """The loss plots' shared frame: (the SVG lines so far: header, ``meta``, the wrapped title,
    the panel's box, the loss ticks and the step ticks; the geometry: left, pw, ph, top, height,
    steps, x_of and y_of). The panel is 480 x 300 with the legend (``legend_width``) to its right;
    the drawing is ``body_height`` (at least the panel's) tall below the title."""
    left, pw, ph, bottom = 60, 480, 300, 45
    width = left + pw + legend_width
    titles = svg_plot.wrap(title, width - 20, 14)
    top = 34 + 18 * (len(titles) - 1)
    height = top + body_height + bottom
    values = [v for ys in series.values() for v in ys]
    pad = (max(values) - min(values)) * 0.03 or 0.5
    lo, hi = min(values) - pad, max(values) + pad
    steps = max(len(ys) for ys in series.values())

    def x_of(i: float) -> float:
        return left + pw * i / max(1, steps - 1)

    def y_of(v: float) -> float:
        return top + ph * (hi - v) / (hi - lo)

    out = [*svg_plot.header(width, height), meta]
    out += [svg_plot.text(10, 20 + 18 * n, line, font_size=14) for n, line in enumerate(titles)]
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>')
    for v in svg_plot.nice_ticks(lo, hi):
        out.append(f'<line x1="{left}" y1="{y_of(v):.1f}" x2="{left + pw}" y2="{y_of(v):.1f}" stroke="#eee"/>'
                   + svg_plot.text(left - 6, y_of(v) + 4, f"{v:g}", text_anchor="end"))
    for i in svg_plot.nice_ticks(0, steps - 1):
        out.append(svg_plot.text(x_of(i), top + ph + 16, f"{i:g}", text_anchor="middle"))
    return out, dict(left=left, pw=pw, ph=ph, top=top, height=height, steps=steps, x_of=x_of, y_of=y_of)


def _axis_titles(svg_plot, g: dict, step_y: float) -> list:
    """The "step" title at ``step_y`` and the rotated loss title, for `_loss_frame`'s geometry g."""
    mid = g["top"] + g["ph"] / 2
    return [svg_plot.text(g["left"] + g["pw"] / 2, step_y, "step", text_anchor="middle"),
            svg_plot.text(16, mid, "loss (mean over ranks)", text_anchor="middle", transform=f"rotate(-90 16 {mid})")]


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
    legend_w = 12 + 34 + max(svg_plot.text_width(e) for e in [*entries.values(), *kinds.values()]) + 10
    out, g = _loss_frame(svg_plot, series, title, legend_w, 300,
                         svg_plot.metadata("train_moe_gpt:write_svg", series=series, title=title))
    left, pw, top, x_of, y_of = g["left"], g["pw"], g["top"], g["x_of"], g["y_of"]
    out += _axis_titles(svg_plot, g, g["height"] - 8)
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


def fp8_comparison(dump: dict, last: int = LAST_STEPS) -> dict:
    """The --compare-fp8 numbers from main's dump: per EP size and seed, the mean over the last
    ``last`` steps of the loss (mean over ranks) of our run without FP8 (``base``) and with it
    (``fp8``), their gap (``fp8 - base``) and relative gap (over ``base``); then per EP size the
    mean of each over the seeds. The allgather runs (the claims say whether alltoall's are the
    same bits)."""
    pairs: dict = {}
    for key, run in dump.items():
        if run["stock"] or run["kind"] != DISPATCHER_KINDS[0]:
            continue
        ep = int(key.split(" ", 2)[1])
        pairs.setdefault((ep, run["seed"]), {})["fp8" if run["fp8"] else "base"] = run
    rows = []
    for (ep, seed), pair in pairs.items():
        if set(pair) != {"base", "fp8"}:
            continue
        base, fp8 = (sum(pair[k]["mean_losses"][-last:]) / len(pair[k]["mean_losses"][-last:]) for k in ("base", "fp8"))
        rows.append(dict(ep=ep, seed=seed, format=pair["fp8"]["fp8"], base=base, fp8=fp8, gap=fp8 - base,
                         relative_gap=(fp8 - base) / base, base_losses=pair["base"]["mean_losses"],
                         fp8_losses=pair["fp8"]["mean_losses"]))
    means = []
    for ep in dict.fromkeys(r["ep"] for r in rows):
        mine = [r for r in rows if r["ep"] == ep]
        means.append(dict(ep=ep, seeds=len(mine),
                          **{k: sum(r[k] for r in mine) / len(mine) for k in ("base", "fp8", "gap", "relative_gap")}))
    return dict(last_steps=min(last, *(len(r["base_losses"]) for r in rows)) if rows else last, rows=rows,
                mean_over_seeds=means)


def print_fp8_table(comparison: dict, dtype: str) -> None:
    """The --compare-fp8 table: a row per EP size and seed, then the mean over the seeds."""
    rows = comparison["rows"]
    if not rows:
        return
    fmt = f"FP8 {rows[0]['format']}"
    print(f"\nFP8 vs {dtype} (ours, allgather): mean loss (mean over ranks) over the last "
          f"{comparison['last_steps']} steps")
    print(f"{'run':<14} | {dtype:>9} | {fmt:>9} | {'FP8 - ' + dtype:>10} | relative")
    for r in [*rows, *comparison["mean_over_seeds"]]:
        name = f"EP {r['ep']} seed {r['seed']}" if "seed" in r else f"EP {r['ep']} mean ({r['seeds']})"
        print(f"{name:<14} | {r['base']:>9.5f} | {r['fp8']:>9.5f} | {r['gap']:>+10.5f} | "
              f"{100 * r['relative_gap']:+.3f}%")


def write_fp8_svg(path: str, series: dict, title: str, last: int = LAST_STEPS) -> None:
    """A plain SVG of {"<run> <dtype>" / "<run> FP8 <format>": [loss per step]} (pairs in that
    order) in one panel: a colour per run (seed), the run without FP8 solid and wide, with FP8
    dashed over it, and a legend entry per curve with its mean over the last ``last`` steps (the
    FP8 entry also its gap). The legend is as wide as its longest entry; the title wraps."""
    import svg_plot

    names = list(series)

    def tail(ys: list) -> float:
        return sum(ys[-last:]) / len(ys[-last:])

    counted = min(last, len(series[names[0]]))
    entries = {}
    for n, name in enumerate(names):
        entries[name] = f"{name}: last {counted} mean {tail(series[name]):.4f}"
        if n % 2:
            base = tail(series[names[n - 1]])
            entries[name] += f" ({tail(series[name]) - base:+.4f}, {100 * (tail(series[name]) - base) / base:+.2f}%)"
    marker = f"from here: the last {counted} steps"
    legend_w = 12 + 34 + max(svg_plot.text_width(e) for e in [*entries.values(), marker]) + 10
    out, g = _loss_frame(svg_plot, series, title, legend_w, max(300, 18 * (len(names) + 2) + 8),
                         svg_plot.metadata("train_moe_gpt:write_fp8_svg", series=series, title=title, last=last))
    left, pw, ph, top, x_of, y_of = g["left"], g["pw"], g["ph"], g["top"], g["x_of"], g["y_of"]
    first = x_of(max(0, g["steps"] - last))  # where the averaged steps start
    out.append(f'<line x1="{first:.1f}" y1="{top}" x2="{first:.1f}" y2="{top + ph}" stroke="#aaa" '
               'stroke-dasharray="2,3"/>')
    out += _axis_titles(svg_plot, g, top + ph + 36)
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    styles = ['stroke-width="3.5" stroke-opacity="0.45"', 'stroke-width="1.5" stroke-dasharray="6,3"']
    lx = left + pw + 12
    for n, name in enumerate(names):
        color, style = colors[(n // 2) % len(colors)], styles[n % 2]
        points = " ".join(f"{x_of(i):.1f},{y_of(v):.1f}" for i, v in enumerate(series[name]))
        out.append(f'<polyline fill="none" stroke="{color}" {style} points="{points}"/>')
        ly = top + 8 + 18 * n
        out.append(f'<line x1="{lx}" y1="{ly}" x2="{lx + 28}" y2="{ly}" stroke="{color}" {style}/>'
                   + svg_plot.text(lx + 34, ly + 4, entries[name]))
    ly = top + 8 + 18 * (len(names) + 1)
    out.append(f'<line x1="{lx + 14}" y1="{ly - 7}" x2="{lx + 14}" y2="{ly + 7}" stroke="#aaa" stroke-dasharray="2,3"/>'
               + svg_plot.text(lx + 34, ly + 4, marker))
    svg_plot.write(path, out)


def fp8_series(comparison: dict, dtype: str) -> dict:
    """write_fp8_svg's series from fp8_comparison's rows: each seed's pair (EP size named where
    there are several)."""
    rows = comparison["rows"]
    several = len({r["ep"] for r in rows}) > 1
    out = {}
    for r in rows:
        name = (f"EP {r['ep']} " if several else "") + f"seed {r['seed']}"
        out[f"{name} {dtype}"] = r["base_losses"]
        out[f"{name} FP8 {r['format']}"] = r["fp8_losses"]
    return out


def main(argv: list[str] | None = None, rank_fn: Callable = rank_main) -> int:
    """The run; ``rank_fn`` (``rank_main`` or a wrapper of it with the same arguments) runs each
    spawned rank."""
    args = build_parser().parse_args(argv)
    args.t0 = time.perf_counter()  # progress lines show the time since the start (spawned ranks get a copy)
    cuda = torch.cuda.is_available() and not args.cpu
    check_args(args, cuda)
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
    where = (f"{world} rank{'s' if world != 1 else ''}, {args.backend}, "
             + ("GPU 0 shared" if args.share_gpu else "CUDA" if cuda else "CPU"))
    print(f"train_moe_gpt: GPTModel {args.layers} layers, H {args.hidden}, E {args.experts}, K {args.topk}, "
          f"{args.dtype}, {args.batch}x{args.seq} tokens per rank per step, {args.steps} steps, Adam lr {args.lr}, "
          f"data {args.data}, seeds {','.join(map(str, args.seed_list))}, fp8 "
          f"{' and '.join(str(f) for f in args.fp8_formats)}; {where}", flush=True)
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
                                               step_seconds=max(r[name]["step_seconds"] for r in ranks),
                                               **{k: run[k] for k in ("variant", "kind", "seed", "fp8", "stock")})
    rows += ep_claims(by_ep)
    last = f"loss step {args.steps - 1}"
    width = max(28, *(len(name) for name in dump))
    print(f"\n{'run':<{width}} | loss step 0 | {last} | s per step (median of steps {WARMUP_STEPS}+, "
          "gradient digests not counted)")
    for name, run in dump.items():
        print(f"{name:<{width}} | {run['mean_losses'][0]:>11.5f} | {run['mean_losses'][-1]:>{len(last)}.5f} | "
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
    comparison = fp8_comparison(dump) if args.compare_fp8 else None
    if comparison:
        print_fp8_table(comparison, args.dtype)
    if args.fp8_svg:
        write_fp8_svg(args.fp8_svg, fp8_series(comparison, args.dtype),
                      f"FP8 vs {args.dtype}: loss per step, ours (allgather); GPTModel {args.layers}x MoE "
                      f"(E {args.experts}, K {args.topk}, H {args.hidden}, ffn {args.ffn}), {where}")
        print(f"wrote {args.fp8_svg}")
    if args.json:
        Path(args.json).write_text(json.dumps({**dump, **({"fp8_comparison": comparison} if comparison else {})},
                                              indent=1) + "\n")
    print("ALL PASS" if not failed else f"{failed} FAIL", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Train a small Megatron GPT model whose MoE layers use moe-dispatch, then save a checkpoint.

    torchrun --nproc-per-node 1 examples/megatron_gpt.py            # one GPU, EP 1, bf16
    torchrun --nproc-per-node 2 examples/megatron_gpt.py --ep 2     # two GPUs, EP 2

A plain megatron-core training loop (GPTModel from the local spec, no TransformerEngine). The lines
marked ``# moe-dispatch`` are all that a Megatron training script adds: our MoE layer comes in
through the layer spec, so the model, its checkpoint and the loop stay Megatron's own. Needs
megatron-core 0.16.1 through 0.19.2 and CUDA: megatron-core's MoE code asks for CUDA devices and
streams even for CPU tensors. Without them the script stops at once, saying what is missing (the
test suite runs ``main`` on CPU ranks, in fp32, through test-only shims: tests/megatron_cpu.py).
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist

from moe_dispatch.config import DISPATCHER_KINDS
from moe_dispatch.integrations.megatron import deterministic_moe_spec  # moe-dispatch (imports no megatron-core)

VOCAB, SEQ, BATCH = 128, 32, 4


def missing() -> Optional[str]:
    """What this script needs and this machine lacks, as one line; None when it can run."""
    try:
        have_megatron = importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        have_megatron = False
    needs = [] if have_megatron else ["megatron-core 0.16.1 through 0.19.2 (pip install '.[megatron]')"]
    if not torch.cuda.is_available():
        needs.append("CUDA, one GPU per rank (megatron-core's MoE code asks for CUDA devices and streams)")
    if not needs:
        return None
    return (f"examples/megatron_gpt.py needs {' and '.join(needs)}. On CPU, `moe-dispatch check` shows the "
            "contract on our own layer")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (divides the ranks and the 8 experts)")
    p.add_argument("--dispatcher", choices=DISPATCHER_KINDS, default="alltoall")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--save", default="megatron_gpt_checkpoint", help="directory for the checkpoint")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    # megatron-core, imported here: the script checks that it is installed before it comes to this.
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = parse_args(argv)
    # megatron-core <= 0.17 logs "Unknown MLP type" for a layer built from a custom MoE spec
    logging.getLogger("megatron.core.transformer.transformer_layer").setLevel(logging.ERROR)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=args.ep)
    model_parallel_cuda_manual_seed(1234)

    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, moe_ffn_hidden_size=128,
        num_moe_experts=8, moe_router_topk=2, moe_token_dispatcher_type=args.dispatcher,
        moe_aux_loss_coeff=1e-2, expert_model_parallel_size=args.ep, bf16=cuda,
        params_dtype=torch.bfloat16 if cuda else torch.float32, use_cpu_initialization=True,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        # no TransformerEngine or Apex: the plain-torch paths
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False)
    spec = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)
    spec = deterministic_moe_spec(spec)  # moe-dispatch: Megatron's MoELayer -> ours, everything else as built
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)
    if config.bf16:  # as Megatron's training loop does: bf16 weights and activations
        model = Float16Module(config, model)
    model = model.to(device).train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    # Data parallelism as Megatron's DDP does it: average dense gradients over the data-parallel
    # group, expert gradients (allreduce=False) over the expert-data-parallel group.
    dense, expert = parallel_state.get_data_parallel_group(), parallel_state.get_expert_data_parallel_group()
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool, device=device), 1)[None, None]
    positions = torch.arange(SEQ, device=device)[None].expand(BATCH, -1)
    gen = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).to(device)
        labels = (3 * tokens + 1) % VOCAB  # a rule the model can learn: the loss falls
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, positions, mask, labels=labels).float().mean()
        loss.backward()
        for p in model.parameters():
            if p.grad is not None:
                group = dense if getattr(p, "allreduce", True) else expert
                p.grad.div_(dist.get_world_size(dense))
                dist.all_reduce(p.grad, group=group)
        opt.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)

    # A checkpoint of Megatron's own state dict; each rank holds its own experts at EP > 1.
    os.makedirs(args.save, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(args.save, f"rank{rank}.pt"))
    if rank == 0:
        print(f"saved {args.save}/rank*.pt", flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    if why := missing():
        # One line, from rank 0 only under torchrun (which then reports the ranks' exit status 1).
        if os.environ.get("RANK", "0") == "0":
            print(why, file=sys.stderr)
        raise SystemExit(1)
    main()

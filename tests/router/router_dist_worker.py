"""Worker for test_router_losses.py's gloo test; a separate module so that the spawned ranks do
not import megatron-core (about 10 s each on the CI machine)."""

import torch
import torch.distributed as dist

from moe_dispatch.config import MoEConfig
from moe_dispatch.router import TopKRouter


def distributed_worker(rank, h, e, k, world, init_file, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        x = torch.randn(6 * 2 * world, h, generator=torch.Generator().manual_seed(0)).view(6 * world, 2, h)
        mine = x[rank * 6 : (rank + 1) * 6]  # the group splits one [S, B, H] micro-batch along S
        out = {}
        for kind in ("aux_loss", "seq_aux_loss", "global_aux_loss"):
            cfg = MoEConfig(
                hidden_size=h, num_experts=e, topk=k, ffn_hidden_size=8, aux_loss_coeff=1e-2,
                load_balancing_type=kind, z_loss_coeff=1e-3, score_function="sigmoid", enable_expert_bias=True,
            )
            router = TopKRouter(cfg, loss_group=dist.group.WORLD, global_loss_group=dist.group.WORLD)
            router(mine)
            out[kind] = {name: v.item() for name, v in router.last_losses.items()}
        router.update_expert_bias(group=dist.group.WORLD)
        out["bias"] = router.expert_bias.tolist()
        results[rank] = out
    finally:
        dist.destroy_process_group()

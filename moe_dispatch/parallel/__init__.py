"""Training expert-parallel layers over data-parallel ranks: the package above the layer's parts
(experts, router) that reduces their gradients across ranks.

- ``data_parallel``: DDP and FSDP2 around the layers (`ignore_experts_in_ddp`,
  `allreduce_expert_grads`, `expert_parameters`), and the layer's checks that a wrapper does not
  own experts that differ across its ranks (`check_ddp`, `check_fsdp`);
- ``gradient_tree``: `GradientTree`, layout-invariant training (docs/parallel.md). It asks the
  experts for per-source weight gradients (``LocalExperts.collect_source_grads``) and the routers
  whether their loss is per micro-batch (``TopKRouter.loss_across_micro_batches``).
"""
from .data_parallel import allreduce_expert_grads, check_ddp, check_fsdp, expert_parameters, ignore_experts_in_ddp
from .gradient_tree import GradientTree

__all__ = ["GradientTree", "allreduce_expert_grads", "check_ddp", "check_fsdp", "expert_parameters",
           "ignore_experts_in_ddp"]

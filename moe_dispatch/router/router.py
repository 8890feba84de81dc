"""`TopKRouter`: gating GEMM + top-k routing + capacity + load-balancing losses.

Batch invariance: for a fixed weight and expert bias, a token's logits, probs and routing map are
bitwise independent of which and how many other tokens share the call (row-stable gating GEMM,
row-local routing). Two things are batch-dependent by definition and excluded:
capacity dropping/padding (``capacity_factor``) and the values of the aux/z losses.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..config import MoEConfig
from ..distributed.agreement import agree_settings
from ..distributed.comm import WeakGroup, group_size_rank
from .capacity import apply_capacity
from .gating import gating_linear
from .losses import (
    all_reduce_counts,
    attach_loss,
    scores_for_aux_loss,
    seq_aux_loss,
    switch_aux_loss,
    z_loss,
)
from .topk import topk_routing

# Added to config.init_seed so the router's weight stream differs from the experts' streams.
ROUTER_SEED_OFFSET = 7919
INIT_STD = 0.02  # Megatron-core's default init_method_std

# Buffers that must stay fp32 when the module is cast (bias steps of 1e-3 vanish in bf16).
_FP32_BUFFERS = ("expert_bias", "local_tokens_per_expert", "global_tokens_per_expert", "ga_steps")


class TopKRouter(nn.Module):
    """Route each token to ``config.topk`` experts.

    Args:
        config: the layer's MoEConfig.
        loss_group: process group over which one micro-batch's tokens are split (Megatron's
            TP x CP group). Token counts for 'aux_loss' and 'seq_aux_loss' are summed over it and
            the z-loss coefficient is divided by its size. None: the tokens are all local.
        global_loss_group: group for 'global_aux_loss' counts (Megatron's TP x DP x CP group).
            With either group, the first forward agrees on every MoEConfig field over it (one
            small all-gather per group, once): a field that differs is the same ValueError on
            every rank of the group, never a rank left waiting in a loss all-reduce.
        check_finite: raise ValueError on NaN/inf logits. On CUDA this costs one device-to-host
            sync per forward (taken after the routing kernels are queued, so the GPU does not
            idle, but the host cannot run ahead of it); pass False to skip it (non-finite logits
            then route arbitrarily).
        device: where to put the weight; it is always generated on the CPU from
            ``config.init_seed + ROUTER_SEED_OFFSET``, so every rank builds the same one.
        ep_group: the expert-parallel group whose ranks route their own tokens (MoELayer passes
            its group). At more than one rank `update_expert_bias` needs a group spanning it.

    Attributes:
        weight: [E, H] gating weight in ``config.params_dtype``.
        expert_bias: [E] fp32 buffer (only with ``enable_expert_bias``), selection only.
        local_tokens_per_expert: [E] fp32 token counts accumulated by training forwards since the
            last `update_expert_bias` (only with ``enable_expert_bias``).
        last_losses: detached values of the losses attached by the last forward, keyed
            'load_balancing_loss', 'seq_load_balancing_loss', 'global_load_balancing_loss',
            'z_loss'; values include their coefficients (divide by it for Megatron's log value).
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        loss_group: Optional["torch.distributed.ProcessGroup"] = None,
        global_loss_group: Optional["torch.distributed.ProcessGroup"] = None,
        check_finite: bool = True,
        device: Optional[torch.device] = None,
        ep_group: Optional["torch.distributed.ProcessGroup"] = None,
    ) -> None:
        super().__init__()
        self.config = config
        # global ranks of the EP group (ints, not the group: a deepcopy must not pickle it); () at EP 1
        ep_size = group_size_rank(ep_group)[0]
        self.ep_ranks = tuple(torch.distributed.get_process_group_ranks(ep_group)) if ep_size > 1 else ()
        self._loss_group = WeakGroup(loss_group, "loss_group")  # weakly, as the layer's ep_group
        self._global_loss_group = WeakGroup(global_loss_group, "global_loss_group")
        # the ranks of each loss group agree on the config before the first loss collective
        self._agreed = loss_group is None and global_loss_group is None
        self.check_finite = check_finite
        e = config.num_experts
        self.weight = nn.Parameter(torch.empty(e, config.hidden_size, dtype=config.params_dtype, device=device))
        if config.enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(e, dtype=torch.float32, device=device))
            self.register_buffer(
                "local_tokens_per_expert", torch.zeros(e, dtype=torch.float32, device=device), persistent=False
            )
        else:
            self.expert_bias = None
            self.local_tokens_per_expert = None
        if config.load_balancing_type == "global_aux_loss" and config.aux_loss_coeff > 0:
            self.register_buffer(
                "global_tokens_per_expert", torch.zeros(e, dtype=torch.float32, device=device), persistent=False
            )
            self.register_buffer("ga_steps", torch.zeros((), dtype=torch.float32, device=device), persistent=False)
        else:
            self.global_tokens_per_expert = None
            self.ga_steps = None
        self.last_losses: Dict[str, torch.Tensor] = {}
        self.reset_parameters()

    @property
    def loss_group(self) -> Optional["torch.distributed.ProcessGroup"]:
        """The group the aux loss's counts are summed over (None: this rank's tokens)."""
        return self._loss_group()

    @property
    def global_loss_group(self) -> Optional["torch.distributed.ProcessGroup"]:
        """The group of global_aux_loss's counts (None: this rank's tokens)."""
        return self._global_loss_group()

    def losses_across_micro_batches(self) -> List[str]:
        """Why this router's losses depend on more than the tokens of the forward that attaches
        them (on earlier forwards, or on other ranks' tokens): one reason each, [] when each loss is
        a function of its own micro-batch. A reducer that sums per-micro-batch gradients in a fixed
        order (`moe_dispatch.parallel.GradientTree`) refuses a router that gives a reason."""
        cfg, reasons = self.config, []
        if cfg.load_balancing_type == "global_aux_loss" and cfg.aux_loss_coeff > 0:
            reasons.append(
                "load_balancing_type='global_aux_loss' averages the token counts over every forward a rank has run "
                "since its last reset (and over global_loss_group), so a micro-batch's loss depends on which other "
                "micro-batches ran on that rank before it. Use 'aux_loss' or 'seq_aux_loss' (per micro-batch)"
            )
        if self.loss_group is not None or self.global_loss_group is not None:
            reasons.append("a router loss group sums token counts over other ranks' tokens")
        return reasons

    def reset_parameters(self) -> None:
        """Re-draw the weight from the config seed (identical on every rank and device)."""
        gen = torch.Generator().manual_seed(self.config.init_seed + ROUTER_SEED_OFFSET)
        w = torch.empty(self.weight.shape, dtype=torch.float32).normal_(0.0, INIT_STD, generator=gen)
        with torch.no_grad():
            self.weight.copy_(w)

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) would cast the fp32 buffers; keep their full-precision values instead.
        saved = {n: self._buffers[n] for n in _FP32_BUFFERS if self._buffers.get(n) is not None}
        out = super()._apply(fn, recurse)
        for name, old in saved.items():
            new = self._buffers[name]
            if new.dtype != torch.float32:
                self._buffers[name] = old.to(device=new.device)
        return out

    # ----------------------------------------------------------------------------------------
    def _check_hidden(self, hidden: torch.Tensor) -> None:
        h = self.config.hidden_size
        if not isinstance(hidden, torch.Tensor):
            raise ValueError(f"hidden must be a torch.Tensor, got {type(hidden).__name__}")
        if hidden.dim() not in (2, 3) or hidden.shape[-1] != h:
            raise ValueError(f"hidden must be [T, {h}] or [S, B, {h}], got shape {tuple(hidden.shape)}")
        if not hidden.is_floating_point():
            raise ValueError(f"hidden must be a floating tensor, got {hidden.dtype}")
        if hidden.device != self.weight.device:
            raise ValueError(f"hidden is on {hidden.device} but router.weight is on {self.weight.device}")

    def gating(self, hidden: torch.Tensor) -> torch.Tensor:
        """Row-stable logits in the router dtype: [T, H] -> [T, E]."""
        return gating_linear(hidden, self.weight, self.config.probs_dtype(hidden.dtype))

    def forward(self, hidden: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Route tokens.

        Args:
            hidden: [T, H] or [S, B, H] (S-major, as Megatron lays out sequences).
        Returns:
            probs: [T, E] in ``config.probs_dtype(hidden.dtype)``, zero outside the map;
            routing_map: [T, E] bool, True where a token goes to an expert (T = S * B).
        """
        self._check_hidden(hidden)
        seq_length, batch = (hidden.shape[0], hidden.shape[1]) if hidden.dim() == 3 else (hidden.shape[0], 1)
        logits = self.gating(hidden.reshape(-1, hidden.shape[-1]))
        return self.routing(logits, seq_length=seq_length, batch=batch)

    # Eager under torch.compile: inductor's generated softmax / sigmoid (and their backward) round
    # differently from ATen's, and a token's bits must not depend on how the layer is run.
    @torch.compiler.disable
    def routing(
        self, logits: torch.Tensor, seq_length: Optional[int] = None, batch: int = 1
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Routing from given logits [T, E] (T = seq_length * batch, S-major) -> (probs, map)."""
        cfg = self.config
        self.last_losses = {}
        seq_length = logits.shape[0] if seq_length is None else seq_length
        if logits.dim() != 2 or logits.shape[1] != cfg.num_experts or seq_length * batch != logits.shape[0]:
            raise ValueError(
                f"logits must be [seq_length * batch, {cfg.num_experts}] = [{seq_length * batch}, "
                f"{cfg.num_experts}], got {tuple(logits.shape)}"
            )
        if not self._agreed:
            self._agree(logits.device)
        # Reduced now, read (one device sync) only after the routing kernels are queued.
        finite = torch.isfinite(logits).all() if self.check_finite else None
        train = self.training and torch.is_grad_enabled()
        if train and cfg.z_loss_coeff and logits.shape[0] > 0:  # the mean of no tokens is NaN
            group_size = 1 if self.loss_group is None else torch.distributed.get_world_size(self.loss_group)
            loss = z_loss(logits, cfg.z_loss_coeff / group_size)
            logits = attach_loss(logits, loss)
            self.last_losses["z_loss"] = loss.detach()
        probs, routing_map = topk_routing(
            logits,
            cfg.topk,
            score_function=cfg.score_function,
            pre_softmax=cfg.pre_softmax,
            num_groups=cfg.num_groups,
            group_topk=cfg.group_topk,
            scaling_factor=cfg.topk_scaling_factor,
            expert_bias=self.expert_bias,
        )
        if cfg.capacity_factor is not None:
            probs, routing_map = apply_capacity(
                probs, routing_map, cfg.topk, cfg.capacity_factor, cfg.drop_policy, cfg.pad_to_capacity
            )
        if finite is not None and not bool(finite):  # before any buffer is updated
            raise ValueError("router logits contain NaN or inf (check the hidden states and router.weight)")
        if train and cfg.aux_loss_coeff > 0 and cfg.load_balancing_type != "none":
            probs = self._attach_aux_loss(probs, logits, seq_length, batch)
        if train and self.local_tokens_per_expert is not None:
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0)
        return probs, routing_map

    def _agree(self, device: torch.device) -> None:
        """Once, before any loss collective, whatever the settings (they decide which collectives
        run: a rank whose aux loss is off would leave its peers waiting in the all-reduce): every
        MoEConfig field is agreed over each loss group, and one that differs is the same
        ValueError on every rank of that group."""
        agreed_over: list = []
        for group, name in ((self.loss_group, "router's loss_group"),
                            (self.global_loss_group, "router's global_loss_group")):
            if group is not None and all(group is not done for done in agreed_over):
                agree_settings(self.config.field_values(), group, device, "router", name)
                agreed_over.append(group)
        self._agreed = True

    def _attach_aux_loss(self, probs: torch.Tensor, logits: torch.Tensor, seq_length: int, batch: int) -> torch.Tensor:
        cfg = self.config
        aux_map, scores = scores_for_aux_loss(logits, cfg.topk, cfg.score_function)
        num_tokens = logits.shape[0]
        # Collectives run on every rank (same call sequence everywhere); a batch with no tokens then
        # gets no loss instead of a division by zero.
        if cfg.load_balancing_type == "aux_loss":
            counts, size = all_reduce_counts(aux_map.sum(dim=0), self.loss_group)
            if num_tokens * size == 0:
                return probs
            loss = switch_aux_loss(scores, counts, num_tokens * size, cfg.topk, cfg.aux_loss_coeff)
            name = "load_balancing_loss"
        elif cfg.load_balancing_type == "seq_aux_loss":
            e = cfg.num_experts
            counts, size = all_reduce_counts(aux_map.view(seq_length, batch, e).sum(dim=0), self.loss_group)
            if seq_length * size == 0:
                return probs
            loss = seq_aux_loss(scores.view(seq_length, batch, e), counts, seq_length * size, cfg.topk,
                                cfg.aux_loss_coeff)
            name = "seq_load_balancing_loss"
        else:  # global_aux_loss: counts averaged over the steps since reset_global_aux_loss_tracker()
            counts, size = all_reduce_counts(aux_map.sum(dim=0), self.global_loss_group)
            if num_tokens * size == 0:
                return probs
            with torch.no_grad():
                self.global_tokens_per_expert += counts
                self.ga_steps += 1
            average = self.global_tokens_per_expert / self.ga_steps
            loss = switch_aux_loss(scores, average, num_tokens * size, cfg.topk, cfg.aux_loss_coeff)
            name = "global_load_balancing_loss"
        self.last_losses[name] = loss.detach()
        return attach_loss(probs, loss)

    # ----------------------------------------------------------------------------------------
    def reset_global_aux_loss_tracker(self) -> None:
        """Start a new averaging window for 'global_aux_loss' (call once per global batch)."""
        if self.global_tokens_per_expert is not None:
            self.global_tokens_per_expert.zero_()
            self.ga_steps.zero_()

    @torch.no_grad()
    def update_expert_bias(
        self,
        tokens_per_expert: Optional[torch.Tensor] = None,
        group: Optional["torch.distributed.ProcessGroup"] = None,
    ) -> None:
        """Aux-loss-free balancing step: ``bias += rate * sign(mean(counts) - counts)``.

        Args:
            tokens_per_expert: [E] token counts of the step; None uses (and then zeroes)
                ``local_tokens_per_expert`` accumulated by training forwards.
            group: if given, counts are summed over it first, so every rank applies the same
                update (pass the data-parallel group). Without it, the caller must pass counts
                that are identical on every rank, or the ranks' biases diverge. At EP > 1
                (``ep_ranks``) it is required and must contain the EP group: its ranks count
                different tokens, and a token's routing must not depend on its rank (summing
                counts that are already equal changes no sign, so the update is the same).
        """
        if self.expert_bias is None:
            raise ValueError("update_expert_bias needs config.enable_expert_bias=True")
        if self.ep_ranks:  # local checks, alike on every EP rank: before the all-reduce
            held = set(torch.distributed.get_process_group_ranks(group)) if group is not None else set()
            if not held.issuperset(self.ep_ranks):
                given = "no group" if group is None else f"a group of {len(held)} ranks without all of them"
                raise ValueError(
                    f"update_expert_bias at EP {len(self.ep_ranks)}: got {given}; expected a group containing every "
                    "rank of the layer's EP group, whose ranks route different tokens (their biases would diverge). "
                    "Pass group= the data-parallel group spanning the EP group (e.g. torch.distributed.group.WORLD)"
                )
        use_local = tokens_per_expert is None
        counts = self.local_tokens_per_expert if use_local else tokens_per_expert
        if counts.shape != self.expert_bias.shape:
            raise ValueError(f"tokens_per_expert must have shape {tuple(self.expert_bias.shape)}, "
                             f"got {tuple(counts.shape)}")
        counts = counts.to(device=self.expert_bias.device, dtype=torch.float32)
        if group is not None:
            counts = counts.clone()
            torch.distributed.all_reduce(counts, group=group)
        offset = counts.sum() / counts.numel() - counts
        self.expert_bias += torch.sign(offset) * self.config.bias_update_rate
        if use_local:
            self.local_tokens_per_expert.zero_()

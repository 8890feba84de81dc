"""A bad input on one EP rank of an install()'d Megatron MoELayer: the same ValueError on every EP
rank, with every collective before our dispatcher still matched (``check_inputs_together``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...dispatcher import hidden_states_problem
from .config import megatron_moe_settings
from .dispatcher import is_installed
from .supported import megatron_field

if TYPE_CHECKING:
    import torch

# Router buffers that a forward updates in place (expert-bias token counts; global aux loss
# accumulators; 0.19's quantile-balancing accumulators): put back when the forward raises, so a
# failed step leaves no trace in the next expert-bias or qb_beta update.
_ROUTER_STEP_BUFFERS = ("local_tokens_per_expert", "global_tokens_per_expert", "ga_steps", "qb_beta_accum",
                        "qb_beta_count")


def check_inputs_together(moe_layer: Any) -> Any:
    """Make a bad ``hidden_states`` on one EP rank raise the same ValueError on every EP rank of an
    install()'d Megatron MoELayer (wraps its ``forward``; ``install`` calls it). Returns moe_layer.

    Megatron's forward runs collectives before our dispatcher's size exchange, on groups that may
    contain other EP ranks (EP is folded over attention TP x CP x DP): the shared experts' TP
    all-gather / reduce-scatter / all-reduce ([S*B, H] sized), the router's aux-loss token counts
    (an all-reduce over tp_cp of [E] for aux_loss and of [B*E] for seq_aux_loss, over tp_dp_cp of
    [E] for global_aux_loss) and 0.19's quantile balancing (an all-gather of the [S*B, E] logits
    over tp_cp). The expert-bias and qb_beta updates and the aux-loss logging reductions run
    outside the forward. So a rank whose input fails ``hidden_states_problem`` (not a float tensor
    of 2 or 3 dims with the hidden size on the layer's device type) does not stop: it runs
    Megatron's forward on zeros of its input's leading shape [S, B] (for a non-tensor input, or one
    whose dims differ from the last good input's: that input's [S, B]; with neither, [1, 1]), so
    every one of those collectives gets the tensors it gets on its peers, and its dispatcher then
    takes part in the size exchange with the problem instead of the data: every EP rank raises the
    same ValueError, naming hidden_states, the expected value and the rank. On the good path this
    adds no collective and no host synchronisation: one host-side check of the input's shape and
    dtype, and a device copy of the router's in-place buffers (at most five [E] tensors, only those
    the config has), which every rank puts back when the forward raises.

    NaN or inf in hidden_states is a float input like any other for Megatron: it reaches the
    router, whose probs turn NaN, and the dispatcher's exchange rejects those on every rank
    (naming probs and the rank). On the first forward the dispatcher also agrees on its
    configuration and on Megatron's MoE settings (``megatron_moe_settings``) with the group,
    before the router's first collective.
    Idempotent."""
    import types

    if megatron_field(moe_layer, "_moe_dispatch_checks_inputs", False):
        return moe_layer

    def forward(self, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        megatron_forward = type(self).forward.__get__(self)  # looked up per call: a deepcopy wraps its own
        intermediate = kwargs.get("intermediate_tensors", args[0] if args else None)
        # CUDA-graph partial replay (not the layer's entry), or a dispatcher swapped back by hand
        if intermediate is not None or not is_installed(self):
            return megatron_forward(hidden_states, *args, **kwargs)
        dispatcher = self.token_dispatcher.dispatcher  # ours, inside Megatron's interface
        device = self.router.weight.device
        if not dispatcher.agreed:
            dispatcher.agree(device, megatron_moe_settings(self.config))
        problem = hidden_states_problem(hidden_states, dispatcher.config.hidden_size, device)
        saved = _router_step_state(self.router)
        try:
            if problem is None:
                self._moe_dispatch_leading_shape = tuple(hidden_states.shape[:-1])
                return megatron_forward(hidden_states, *args, **kwargs)
            padding_mask = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)
            _forward_standing_in(self, megatron_forward, problem, hidden_states, padding_mask, device)
        except BaseException:
            _restore_router_step_state(self.router, saved)
            raise

    moe_layer.forward = types.MethodType(forward, moe_layer)
    moe_layer._moe_dispatch_checks_inputs = True
    return moe_layer


def _router_step_state(router: Any) -> dict:
    import torch

    if not torch.is_grad_enabled():  # Megatron updates these only with grad enabled
        return {}
    buffers = ((name, megatron_field(router, name)) for name in _ROUTER_STEP_BUFFERS)
    return {name: b.detach().clone() for name, b in buffers if isinstance(b, torch.Tensor)}


def _restore_router_step_state(router: Any, saved: dict) -> None:
    import torch

    with torch.no_grad():
        for name, value in saved.items():
            getattr(router, name).copy_(value)


def _forward_standing_in(layer: Any, megatron_forward: Any, problem: Any, hidden_states: Any, padding_mask: Any,
                         device: "torch.device") -> None:
    """This rank's bad input: Megatron's forward on zeros of the same leading shape (so its
    collectives before the dispatcher match its peers'), its dispatch_preprocess replaced for this
    call by the size exchange with the problem. Always raises."""
    import torch

    # The input's own [S, B] (or [T]) where it has as many dims as this layer's last good input,
    # else that input's: a seq_aux_loss all-reduce is [B * E], a [T, H] stand-in would send [E].
    last = megatron_field(layer, "_moe_dispatch_leading_shape")
    own = tuple(hidden_states.shape[:-1]) if isinstance(hidden_states, torch.Tensor) and \
        hidden_states.dim() in (2, 3) else None
    leading = own if own is not None and (last is None or len(own) == len(last)) else (last or (1, 1))
    dtype = layer.config.params_dtype
    stand_in = torch.zeros((*leading, layer.config.hidden_size), dtype=dtype, device=device)
    # padding_mask [B, S]: kept where it fits the stand-in (it changes no collective's size)
    if not (isinstance(padding_mask, torch.Tensor) and len(leading) == 2 and
            tuple(padding_mask.shape) == tuple(reversed(leading))):
        padding_mask = None
    wrapper = layer.token_dispatcher

    def raise_in_exchange(*_: Any) -> None:
        wrapper.dispatcher.raise_together(problem, device)

    wrapper.dispatch_preprocess = raise_in_exchange  # this call only (an instance attribute)
    try:  # in the caller's grad mode: the aux losses (and their all-reduces) run only with grad enabled
        megatron_forward(stand_in, intermediate_tensors=None, padding_mask=padding_mask)
    finally:
        del wrapper.dispatch_preprocess
    # Megatron's forward did not reach the dispatcher (it cannot, in the supported settings).
    wrapper.dispatcher.raise_together(problem, device)



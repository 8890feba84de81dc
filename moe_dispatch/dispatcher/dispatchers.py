"""AllToAllDispatcher and AllGatherDispatcher: dispatch/combine as objects over the functional
form, with the configuration agreed with the group once."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..config import DispatchConfig, MoEConfig, as_dispatch_config
from ..distributed.agreement import GROUP_LATCHES, DeviceProblem, InputProblem, agree_config
from ..distributed.comm import ProcessGroup, WeakGroup, group_size_rank
from ..distributed.identity import StepCounter, new_layer_id
from . import functional
from .dropless.layout import check_ep_size, exchange_sizes
from .plan import DispatchHandle
from .stages import device_of
from .sync_free.plan import BAD_INPUT, agreed_hidden


class _Dispatcher:
    kind = ""

    def __init__(self, config: MoEConfig | DispatchConfig, ep_group: ProcessGroup = None) -> None:
        """config: a MoEConfig or DispatchConfig (its kind must be this class's, if it has one);
        ep_group: the expert-parallel ProcessGroup (None: the default group, or one process).
        Raises ValueError if num_experts is not divisible by the EP size, or if ep_group does not
        contain this process or was destroyed (before any collective).

        The dispatcher takes the next layer id of its EP group (``identity``: construction order;
        every rank must build its dispatchers on the group in the same order)."""
        self.config: DispatchConfig = as_dispatch_config(config, self.kind or None)
        self._ep_group = WeakGroup(ep_group)  # a layer kept to the end of a script keeps no destroyed group alive
        # Errors found after a size exchange wait here for the group's next one (shared with
        # every dispatcher on the group: see agreement.GroupLatches).
        self.latch = GROUP_LATCHES.of(ep_group)
        self.ep_size, self.ep_rank = group_size_rank(ep_group)
        self.num_local_experts = check_ep_size(self.config.num_experts, self.ep_size)
        first = self.ep_rank * self.num_local_experts
        self.local_expert_indices = list(range(first, first + self.num_local_experts))
        if self.config.sync_free and self.ep_size > 1 and self.config.ep_capacity_factor is None:
            raise ValueError(f"sync_free=True at EP size {self.ep_size} needs ep_capacity_factor (the static-capacity "
                             f"exchange), got None")
        self._agreed = self.ep_size == 1  # configuration agreed with the group (once, lazily)
        self.layer_id = new_layer_id(ep_group)
        self.steps = StepCounter(self.layer_id)  # this layer's forwards (identity.CallId)

    def __deepcopy__(self, memo: dict) -> "_Dispatcher":
        """A copy (of a layer, e.g. for EMA weights) is a new layer on the same group, sharing the
        group and its error latch (a ProcessGroup cannot be copied): it takes the next layer id, as
        a dispatcher built now would (so every rank must copy in the same order), and agrees its
        configuration at its first forward. The copy and the original are then different layers,
        whose calls are never paired up for each other's."""
        new = type(self)(self.config, self.ep_group)
        memo[id(self)] = new
        return new

    @property
    def ep_group(self) -> ProcessGroup:
        """The expert-parallel group (None: the default group, or one process)."""
        return self._ep_group()

    @property
    def agreed(self) -> bool:
        """True once the configuration is agreed with the group (always, for one process)."""
        return self._agreed

    def agree(self, device: torch.device, settings: Sequence[tuple[str, Any]] = ()) -> None:
        """Agree on the configuration with the group (one fixed-size exchange), the first time
        only; dispatch does it too. A layer calls it before its own first collective, passing its
        own settings (router, experts) as (name, value) pairs to be agreed in the same exchange."""
        if not self._agreed:
            agree_config(self.config, self.ep_group, device, settings, self.layer_id)
            self._agreed = True

    # ---- functional form -----------------------------------------------------------------
    def dispatch(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor,
                 handle: Optional[DispatchHandle] = None, experts_need_grad: Optional[bool] = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """(expert_input [N, H], tokens_per_expert CPU int64 [El], handle); see functional.dispatch
        (``handle``: reuse a previous step's, for activation recomputation). ``experts_need_grad``:
        whether the experts that will run on the rows have trainable weights, for a caller that
        knows (a layer); None: assumed under grad mode (the combine's output then requires grad on
        every rank, so that every rank's backward runs the combine's backward exchange). Sync-free
        (``config.sync_free``): tokens_per_expert is read from the device; ``dispatch_rows`` is not."""
        rows, new = self.dispatch_rows(hidden_states, routing_map, probs, handle, experts_need_grad)
        return functional.with_host_rows_per_expert(rows, new)

    def dispatch_rows(self, hidden_states: Any, routing_map: torch.Tensor, probs: torch.Tensor,
                      handle: Optional[DispatchHandle] = None, experts_need_grad: Optional[bool] = None,
                      *, device_problem: Optional[DeviceProblem] = None) -> tuple[torch.Tensor, DispatchHandle]:
        """dispatch without tokens_per_expert: (expert_input [N, H], handle); no host read in the
        sync-free mode. hidden_states None: this rank's input was bad (sync-free at EP > 1, see
        MoELayer.forward): it takes part with zeros and the step's outputs are NaN everywhere.

        ``device_problem``: a problem with this rank's input found on the device (code 0: none),
        raised on every rank without a host read of its own. Where this step runs a size exchange
        (dropless; a sync-free plan's first step at EP > 1) it travels in it: every rank raises before
        any row moves. Sync-free otherwise it sets the step's input word (sync_free/words.py): the
        step's outputs are NaN on every rank, and every rank raises at the next poll (at EP 1 on
        CPU: here, at once)."""
        if hidden_states is None:
            hidden_states = BAD_INPUT
        if handle is None:
            self.agree(device_of(hidden_states) if isinstance(hidden_states, torch.Tensor) else probs.device)
        in_exchange = device_problem is not None and handle is None and (
            not self.sync_free or (self.ep_size > 1 and self.sync_free_agreed_input() is None))
        if in_exchange:
            self.latch.set(device_problem.code, device_problem.expected, device_problem.got)
        rows, new = functional.dispatch_rows(hidden_states, routing_map, probs, self.config, self.ep_group,
                                             handle=handle, latch=self.latch, agreed=True, steps=self.steps,
                                             experts_grad=experts_need_grad)
        if device_problem is not None and not in_exchange:
            new.plan.flag_input(new, device_problem)
        return rows, new

    @property
    def sync_free(self) -> bool:
        """The sync-free dispatch (sync_free/): no host read per step."""
        return self.config.sync_free

    def sync_free_agreed_input(self) -> Optional[tuple[torch.Size, torch.dtype]]:
        """Sync-free at EP > 1 after the first step: the agreed hidden_states (shape, dtype)."""
        if not (self.config.sync_free and self.ep_size > 1):
            return None
        return agreed_hidden(self.ep_group, self.config)

    def combine(self, expert_output: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """expert_output [N, H] -> hidden_states' shape; see functional.combine."""
        return functional.combine(expert_output, handle)

    def raise_together(self, problem: InputProblem, device: torch.device) -> None:
        """Take part in this step's size exchange with a locally found problem (e.g. from
        ``agreement.hidden_states_problem``): every rank of the group (those in dispatch, and this
        one) raises the same ValueError. Always raises."""
        self.agree(device)
        exchange_sizes(None, None, None, self.config, self.ep_group, self.latch, problem=problem, device=device,
                       call=self.steps.call())
        raise AssertionError("exchange_sizes returned despite a problem")  # unreachable: it raises


class AllToAllDispatcher(_Dispatcher):
    """Deduplicated uneven all-to-all: a token crosses the wire once per rank that owns any of its
    experts; expert outputs come back unreduced to the owner (all-to-all)."""

    kind = "alltoall"


class AllGatherDispatcher(_Dispatcher):
    """All-gather of tokens, routing and probs; expert outputs come back unreduced to the owner
    through an all-to-all (never a reduce-scatter)."""

    kind = "allgather"


def build_dispatcher(config: MoEConfig | DispatchConfig, ep_group: ProcessGroup = None) -> _Dispatcher:
    """The dispatcher of config's kind (a MoEConfig's ``dispatcher``, a DispatchConfig's ``kind``)."""
    cfg = as_dispatch_config(config)
    named = {cls.kind: cls for cls in _Dispatcher.__subclasses__()}
    return named.get(cfg.kind, _Dispatcher)(cfg, ep_group)

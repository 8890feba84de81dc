"""`GroupedMLP` and `SequentialMLP`: the local experts of one EP rank.

Both hold the same parameters and compute the same function; they differ only in how the expert
GEMMs run (`moe_dispatch.experts.gemm`):

- ``weight1`` [E_local, H, fc1_out] (fc1_out = 2 * ffn for swiglu, else ffn),
- ``weight2`` [E_local, ffn, H],

in ``config.params_dtype``; ``y = act(x @ weight1[e]) @ weight2[e]`` for the rows of expert e.
Local expert i is global expert ``local_expert_offset + i``; its weights come from
(``config.init_seed``, global id) only (`moe_dispatch.experts.init`).

Identity in the state dict: ``state_dict()`` also holds ``expert_ids`` (int64 [E_local], the
global ids), and ``load_state_dict`` takes each local expert's rows by id (a state dict that
lacks one of them is a ValueError naming the ids, never a silent load of other experts). Given
``ep_group`` (EP size > 1), ``weight1``, ``weight2`` and ``expert_ids`` are DTensor shards
(``Shard(0)`` over the EP group) of the global [E, ...] tensors, so torch.distributed.checkpoint
saves each rank's experts as its own shard and loads them back at any EP size. An optimizer's
state for the sharded weights is exposed the same way (`moe_dispatch.checkpoint`). ``expert_ids``
is also an attribute (the FQN torch.distributed.checkpoint.state_dict resolves for that key).

``copy.deepcopy`` (e.g. EMA weights): the copy holds the same experts of the same EP group; it
shares the group (a ProcessGroup cannot be copied) and copies the weights.

Row stability (default ``row_stable=True``): a row's output and its input gradient do not depend
on how many rows its expert received, on where the row sits, or on the other experts' rows. It
holds per GEMM strategy and activation as documented in `gemm` and `activations`. Weight
gradients are per-expert sums over that expert's rows: deterministic, and equal at any EP size
when the expert receives the same rows in the same order. ``row_stable=False`` allows faster
paths that lose this (plain per-expert mm, or grouped_mm).

GroupedMLP and SequentialMLP are bitwise equal where both take the same strategy (CPU: both
"ordered", every dtype; CUDA fp32: both "tiled"). Where GroupedMLP runs grouped_mm (CUDA bf16)
the two are different kernels and may differ in the last bits; they agree within rounding.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import register_sharded
from ..config import FP8_FORMATS
from ..distributed.agreement import FP8_WEIGHTS_NOT_FP8, InputProblem, problem_message
from ..distributed.comm import WeakGroup
from .activations import activate, scale_rows
from .fp8 import fp8_mlp, fp8_rows_problem
from .fp8_weights import Fp8ExpertWeights, fp8_weights_bits_problem, fp8_weights_problem, quantize_fp8_weights
from .gemm import GemmStrategy, expert_gemm, select_gemm
from .init import WEIGHT1, WEIGHT2, init_expert_weights
from .rows import ExpertRows
from .source_grads import SourceGrads


class LocalExperts(nn.Module):
    """Shared parameters, init and forward; subclasses choose the GEMM strategy."""

    prefer_grouped: bool = False

    def __init__(
        self,
        config: Any,
        num_local_experts: int,
        local_expert_offset: int = 0,
        *,
        row_stable: bool = True,
        row_tile: int = 0,
        device: Optional[torch.device | str] = None,
        ep_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        """``config``: a `moe_dispatch.config.MoEConfig` (reads hidden_size, ffn_hidden_size,
        num_experts, activation, init_seed, params_dtype, probs_in_experts, fp8, fp8_wgrad).
        ``row_stable``: False allows the faster non-row-stable paths (see the module docstring).
        ``row_tile``: rows per GEMM call of the "tiled" fallback (CUDA); 0 = 256.
        ``ep_group``: the expert-parallel group whose rank r holds experts r*E_local.. (as the
        dispatchers place them); with more than one rank the state dict holds DTensor shards
        (module docstring). None: plain tensors."""
        super().__init__()
        if num_local_experts < 1 or local_expert_offset < 0:
            raise ValueError("num_local_experts must be >= 1 and local_expert_offset >= 0")
        if local_expert_offset + num_local_experts > config.num_experts:
            raise ValueError(
                f"local experts {local_expert_offset}..{local_expert_offset + num_local_experts - 1} "
                f"exceed num_experts={config.num_experts}"
            )
        if config.activation not in ("gelu", "relu", "swiglu"):
            raise ValueError(f"unknown activation {config.activation!r}")
        self.hidden_size = config.hidden_size
        self.ffn_hidden_size = config.ffn_hidden_size
        self.activation = config.activation
        self.probs_in_experts = bool(config.probs_in_experts)
        self.fp8 = config.fp8  # None, or the FP8 format of the GEMMs (`moe_dispatch.experts.fp8`)
        self.fp8_wgrad = config.fp8_wgrad  # the weight gradients in FP8 too, or in the tokens' dtype
        self.init_seed = config.init_seed
        self.num_local_experts = num_local_experts
        self.local_expert_offset = local_expert_offset
        self.row_stable = row_stable
        self.row_tile = row_tile
        # held weakly (distributed.comm.WeakGroup): a model kept to the end of a script must not keep
        # a destroyed group alive
        self._ep_group = WeakGroup(_sharding_group(ep_group, config.num_experts, num_local_experts,
                                                   local_expert_offset))
        # a weak reference to the DeviceMesh of ep_group, built at a state_dict(): a mesh holds its
        # group, so a strong one would keep the group alive as WeakGroup avoids
        self._ep_mesh: Optional[weakref.ref] = None
        # Per-source weight gradients: off until a consumer hands a store (collect_source_grads).
        self._source_grads: Optional[SourceGrads] = None
        fc1_out = 2 * self.ffn_hidden_size if self.activation == "swiglu" else self.ffn_hidden_size
        kw = dict(dtype=config.params_dtype, device=device)
        self.weight1 = nn.Parameter(torch.empty(num_local_experts, self.hidden_size, fc1_out, **kw))
        self.weight2 = nn.Parameter(torch.empty(num_local_experts, self.ffn_hidden_size, self.hidden_size, **kw))
        self.reset_parameters()
        if self.ep_group is not None:
            register_sharded(self)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "LocalExperts":
        # The copy holds the same experts on the same group: share the group and its mesh.
        for shared in (self._ep_group, self._ep_mesh):
            if shared is not None:
                memo[id(shared)] = shared
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        # a copy is no consumer's: it collects no per-source gradients, its weights take .grad as usual
        state = copy.deepcopy({k: v for k, v in self.__dict__.items() if k not in ("_ddp_checked", "_source_grads")},
                              memo)
        new.__setstate__(state)
        new._source_grads = None
        if new.ep_group is not None:
            register_sharded(new)
        return new

    @property
    def ep_group(self) -> Optional[dist.ProcessGroup]:
        """The group the experts are sharded over (EP size > 1), else None."""
        return self._ep_group()

    def collect_source_grads(self, store: Optional[SourceGrads]) -> None:
        """Per-(local expert, source) weight gradients on (``store``) or off (None): while on, a
        forward whose rows carry source blocks (``ExpertRows.source_blocks``; `MoELayer` passes
        them exactly then) adds at its backward each weight's [E_local, P, ...] gradient to
        ``store`` (`moe_dispatch.experts.source_grads`) instead of accumulating into ``.grad``.
        `moe_dispatch.parallel.GradientTree` turns it on for the sharded experts it reduces."""
        if store is not None and not isinstance(store, SourceGrads):
            raise ValueError(f"store must be a moe_dispatch.experts.SourceGrads or None, got {type(store).__name__}")
        self._source_grads = store

    @property
    def source_grads(self) -> Optional[SourceGrads]:
        """The store the per-source weight gradients go to, or None (off); set by `collect_source_grads`."""
        return self._source_grads

    @property
    def global_expert_ids(self) -> range:
        return range(self.local_expert_offset, self.local_expert_offset + self.num_local_experts)

    @property
    def expert_ids(self) -> torch.Tensor:
        """int64 [E_local]: the global ids of the local experts (the state dict's ``expert_ids``)."""
        return torch.tensor(list(self.global_expert_ids), dtype=torch.int64, device=self.weight1.device)

    def global_shard(self, local: torch.Tensor) -> Any:
        """``local`` [E_local, ...] (a weight, or a tensor shaped like one: its optimizer state) ->
        a DTensor ``Shard(0)`` over the EP group of the global [E, ...], row i the global expert i;
        no copy (torch.distributed.checkpoint loads into ``local``). Only with ``ep_group``."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        if self.ep_group is None:
            raise ValueError("global_shard: these experts are not sharded (no ep_group of more than one rank)")
        mesh = self._ep_mesh() if self._ep_mesh is not None else None  # alive while a shard of it is
        if mesh is None:
            mesh = DeviceMesh.from_group(self.ep_group, self.weight1.device.type)
            self._ep_mesh = weakref.ref(mesh)
        shape = torch.Size((self.num_local_experts * mesh.size(), *local.shape[1:]))
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape,
                                  stride=_contiguous_stride(shape))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """normal(0, 1/sqrt(fan_in)) per expert from its own seeded generator (keeps the output
        scale independent of H and ffn; Megatron's default is normal(0, 0.02))."""
        ids = list(self.global_expert_ids)
        for param, which, fan_in in ((self.weight1, WEIGHT1, self.hidden_size),
                                     (self.weight2, WEIGHT2, self.ffn_hidden_size)):
            w = init_expert_weights(param.shape[1:], self.init_seed, ids, which, fan_in**-0.5, param.dtype,
                                    param.device)
            param.copy_(w)

    def gemm_strategies(self, x: torch.Tensor) -> Tuple[GemmStrategy, GemmStrategy]:
        """The (fc1, fc2) strategies a forward on ``x`` [N, H] would use."""
        # Selection reads only dtype, device and shapes: empty stand-ins avoid casting the weights.
        w1 = x.new_empty(0, 0, self.weight1.shape[2])
        w2 = x.new_empty(0, 0, self.hidden_size)
        act = x.new_empty(0, self.ffn_hidden_size)
        return (
            select_gemm(x, w1, self.prefer_grouped, self.row_stable),
            select_gemm(act, w2, self.prefer_grouped, self.row_stable),
        )

    def forward(
        self,
        rows: ExpertRows | torch.Tensor,
        rows_per_expert: Optional[torch.Tensor] = None,
        probs: Optional[torch.Tensor] = None,
        *,
        offsets: Optional[torch.Tensor] = None,
        fp8_weights: Optional[Fp8ExpertWeights] = None,
        fp8_weights_checked: bool = False,
    ) -> torch.Tensor:
        """rows (an ``ExpertRows``: the rows [N, H], expert-major, and how they split by expert) ->
        [N, H] in the rows' dtype (FP8: in their ``grad_sink``'s). A plain call may pass the rows
        [N, H], ``rows_per_expert`` int [E_local] (CPU or device, summing to N) and ``probs`` [N] or
        None, with ``offsets`` (int32 [E_local] on the rows' device, cumsum(rows_per_expert), e.g. the
        dispatcher's ``handle.expert_offsets``, so that grouped GEMMs copy nothing to the device):
        ``ExpertRows.of`` builds the record. The dispatcher's rows: ``to_expert_rows(expert_input,
        handle)`` (``moe_dispatch.dispatcher``), whose trailing rows (sync-free) and per-source blocks
        travel in the record (see ``ExpertRows``).

        With ``config.probs_in_experts`` and probs given, the activation is multiplied by each
        row's prob before fc2 (in float32 at least, rounded once), as Megatron's experts do;
        otherwise probs are ignored (the combine applies them).

        ``rows.source_blocks`` (the (local expert, source) blocks, the dispatcher's ``handle.source_blocks``:
        host [E_local][P] (first row, rows), or a sync-free plan's device rows [E_local, P], see
        ``gemm.SourceBlocks``), only while per-source gradients are on (`collect_source_grads`): each
        weight's gradient is computed per block and added to the store as [E_local, P, ...] in the weight's dtype;
        ``.grad`` is left alone. Output and input gradient are unchanged. With FP8 wgrad
        (``config.fp8_wgrad``) the column scales are per (expert, source) block.

        FP8 (``config.fp8``): ``rows.rows`` are ``Fp8Rows`` (the dispatcher's FP8 rows: fp8 values
        [N, H], scales [N] fp32, and the grad_sink [N, H] their gradient goes to, whose dtype is the
        output's). Both GEMMs run in FP8
        (`moe_dispatch.experts.fp8.fp8_expert_gemm`); the activation in the output dtype.
        ``fp8_weights``: the weights quantised once (``quantize_fp8_weights()``), for the forwards
        until the next optimizer step; a stale one raises a ValueError (`moe_dispatch.experts.fp8_weights`).
        Its weights' bits are compared with a host read (on CUDA a synchronisation);
        ``fp8_weights_checked=True``: the caller has checked the handle, bits included (MoELayer does,
        carrying the result in its dispatcher's exchanges), and the experts do not check it again.
        """
        if not isinstance(rows, ExpertRows):
            rows = ExpertRows.of(rows, rows_per_expert, probs, offsets)
        elif rows_per_expert is not None or probs is not None or offsets is not None:
            raise ValueError("LocalExperts.forward: given an ExpertRows, pass rows_per_expert, probs and offsets "
                             "inside it (dataclasses.replace), not beside it")
        if self.fp8 is not None:
            return self._forward_fp8(rows, fp8_weights, fp8_weights_checked)
        if fp8_weights is not None:
            raise ValueError(problem_message(FP8_WEIGHTS_NOT_FP8, 0, 0))
        x, counts = rows.rows, rows.gemm_counts
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"rows must be a tensor [N, {self.hidden_size}] (Fp8Rows need experts with config.fp8), "
                             f"got {type(x).__name__}")
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"rows must be [N, {self.hidden_size}], got {tuple(x.shape)}")
        if counts.shape != (self.num_local_experts,):
            raise ValueError(f"rows_per_expert must be [{self.num_local_experts}], got {tuple(counts.shape)}")
        # Weights follow the activations' dtype (e.g. float32 master weights, bf16 compute).
        w1, w2 = self.weight1.to(x.dtype), self.weight2.to(x.dtype)
        blocks, trailing = rows.source_blocks, rows.trailing_rows
        sinks = (None, None) if blocks is None else (self._sink("weight1"), self._sink("weight2"))
        s1 = select_gemm(x, w1, self.prefer_grouped, self.row_stable)
        h = expert_gemm(x, w1, counts, s1, self.row_tile, rows.offsets, trailing, blocks, sinks[0])
        act = activate(h, self.activation)
        if self.probs_in_experts and rows.probs is not None:
            if rows.probs.shape != (x.shape[0],):
                raise ValueError(f"probs must be [{x.shape[0]}], got {tuple(rows.probs.shape)}")
            act = scale_rows(act, rows.probs)
        s2 = select_gemm(act, w2, self.prefer_grouped, self.row_stable)
        return expert_gemm(act, w2, counts, s2, self.row_tile, rows.offsets, trailing, blocks, sinks[1])

    def _forward_fp8(self, rows: ExpertRows, fp8_weights: Optional[Fp8ExpertWeights],
                     fp8_weights_checked: bool) -> torch.Tensor:
        problem = fp8_rows_problem(rows)  # before the handle's checks, which may read the device
        if problem is not None:
            raise ValueError(problem)
        operands = None
        if fp8_weights is not None:
            if not fp8_weights_checked:
                _check_fp8_weights(fp8_weights, self)
            operands = (fp8_weights.weight1, fp8_weights.weight2)
        sinks = (None, None) if rows.source_blocks is None else (self._sink("weight1"), self._sink("weight2"))
        return fp8_mlp(rows, self.weight1, self.weight2, self.activation, apply_probs=self.probs_in_experts,
                       fp8_dtype=FP8_FORMATS[self.fp8], weight_operands=operands, fp8_wgrad=self.fp8_wgrad,
                       sinks=sinks)

    def quantize_fp8_weights(self) -> Fp8ExpertWeights:
        """weight1 and weight2 quantised for the FP8 GEMMs, once: pass the result to the forwards of
        the micro-batches until the next optimizer step (`moe_dispatch.experts.fp8_weights`)."""
        return quantize_fp8_weights(self)

    def _sink(self, name: str) -> Callable[[torch.Tensor], None]:
        """Where the per-source gradient of weight ``name`` goes (the `collect_source_grads` store),
        cast to the weight's dtype."""
        store = self._source_grads
        if store is None:
            raise ValueError("rows.source_blocks given, but per-source weight gradients are off: call "
                             "collect_source_grads(SourceGrads()) first (moe_dispatch.parallel.GradientTree does)")
        dtype = getattr(self, name).dtype
        return lambda grad: store.add(name, grad.to(dtype))

    # ---- state dict: expert identity, DTensor shards for torch.distributed.checkpoint ----------

    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "expert_ids"] = self.expert_ids
        if self.ep_group is None:
            return
        _refuse_fsdp_sharded(self, prefix)
        for name in _SHARDED_KEYS:
            # No copy: DCP loads straight into the parameters, as it does for torchtitan's DTensors.
            destination[prefix + name] = self.global_shard(destination[prefix + name])

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, local_metadata: Dict[str, Any],
                              strict: bool, missing_keys: List[str], unexpected_keys: List[str],
                              error_msgs: List[str]) -> None:
        from torch.distributed.tensor import DTensor

        # ``state_dict`` is load_state_dict's own copy for this module: replacing entries is safe.
        for name in _SHARDED_KEYS:
            value = state_dict.get(prefix + name)
            if isinstance(value, DTensor):
                state_dict[prefix + name] = value.to_local()
        ids = state_dict.pop(prefix + "expert_ids", None)
        if ids is None:
            missing_keys.append(prefix + "expert_ids")  # a state dict without identity: strict loads refuse it
        else:
            rows = _rows_of(ids, list(self.global_expert_ids), prefix)
            for name in ("weight1", "weight2"):
                value = state_dict.get(prefix + name)
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == ids.numel():
                    state_dict[prefix + name] = value[rows] if rows is not None else value
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        return (
            f"experts={self.local_expert_offset}..{self.local_expert_offset + self.num_local_experts - 1}, "
            f"hidden={self.hidden_size}, ffn={self.ffn_hidden_size}, activation={self.activation}, "
            f"row_stable={self.row_stable}"
        )


_SHARDED_KEYS = ("weight1", "weight2", "expert_ids")


def _check_fp8_weights(fp8_weights: Any, experts: LocalExperts) -> None:
    """ValueError if ``fp8_weights`` cannot serve a forward of ``experts`` now: the host checks,
    then the weights' bits (one host read of the comparison)."""
    problem = fp8_weights_problem(fp8_weights, experts)
    if problem is None:
        bits = fp8_weights_bits_problem(fp8_weights, experts)
        code, expected, got = torch.stack([bits.code, bits.expected, bits.got]).tolist()
        problem = InputProblem(code, expected, got) if code else None
    if problem is not None:
        raise ValueError(problem_message(problem.code, problem.expected, problem.got))


def _sharding_group(ep_group: Optional[dist.ProcessGroup], num_experts: int, num_local: int,
                    offset: int) -> Optional[dist.ProcessGroup]:
    """``ep_group`` if it shards the experts (more than one rank), checked against the layout."""
    if ep_group is None or dist.get_world_size(ep_group) == 1:
        return None
    size, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    if num_local * size != num_experts or offset != rank * num_local:
        raise ValueError(
            f"ep_group: rank {rank} of {size} holds experts {rank * num_local}..{(rank + 1) * num_local - 1} "
            f"of num_experts={num_experts}, but these experts are {offset}..{offset + num_local - 1} of "
            f"{num_local * size}"
        )
    return ep_group


def _refuse_fsdp_sharded(experts: LocalExperts, prefix: str) -> None:
    """ValueError if FSDP2 shards these EP-sharded weights (they are DTensors at rest): their shards
    of shards have no global expert ids here (the forward refuses them too, `parallel.check_fsdp`)."""
    from torch.distributed.tensor import DTensor

    if isinstance(experts.weight1, DTensor):
        raise ValueError(
            f"state_dict(): {prefix}weight1 (routed experts at EP > 1) is sharded by FSDP2 (fully_shard), which "
            "is not supported. Leave the routed experts out: fully_shard(model, mesh=..., ignored_params=set(p for "
            "_, p in moe_dispatch.parallel.expert_parameters(model))); the state dict then holds them as DTensor "
            "shards over the EP group"
        )


def _contiguous_stride(shape: torch.Size) -> Tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def _rows_of(ids: torch.Tensor, wanted: List[int], prefix: str) -> Optional[torch.Tensor]:
    """Positions of the ``wanted`` global expert ids in a state dict's ``expert_ids`` (None if
    they are exactly those ids); a ValueError naming the ids if some are missing."""
    held = [int(i) for i in ids.reshape(-1).tolist()]
    if held == wanted:
        return None
    missing = [i for i in wanted if i not in held]
    if missing:
        raise ValueError(
            f"{prefix}expert_ids: the state dict holds global experts {held}, these experts are {wanted} "
            f"(experts {missing} are missing: a state dict saved on another EP rank or at another EP size; "
            "save and load with torch.distributed.checkpoint to reshard)"
        )
    return torch.tensor([held.index(i) for i in wanted], dtype=torch.int64, device=ids.device)


class GroupedMLP(LocalExperts):
    """Local experts through ``torch._grouped_mm`` where it is available and (by default)
    row-stable: CUDA bf16 (sm90+) with 16-byte aligned rows. Elsewhere the row-stable paths
    ("ordered" on CPU, "tiled" on CUDA); with ``row_stable=False``, grouped_mm wherever it runs
    (also on CPU, not row-stable there) else the plain per-expert loop."""

    prefer_grouped = True


class SequentialMLP(LocalExperts):
    """Local experts one at a time: "ordered" on CPU (no BLAS, a fixed summation order), "tiled"
    on CUDA (plain mm in fixed 256-row calls), so a row's result never changes with the row count.
    ``row_stable=False`` multiplies exactly each expert's rows with mm, as Megatron's
    SequentialMLP does (faster, not row-stable)."""

    prefer_grouped = False

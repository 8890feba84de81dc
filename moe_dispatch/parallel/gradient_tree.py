"""GradientTree: every gradient reduced by one fixed binary tree over the step's micro-batches.

One optimizer step covers L = W x A micro-batches (W ranks in ``group``, A micro-batches each); the
rank of group rank r runs global micro-batch a*W + r at its a-th micro-step (``micro_batch_index``:
the ranks take turns, as DistributedSampler deals samples). Each micro-batch's gradient of every
parameter is a function of that micro-batch alone (a leaf), and the leaves are summed by the tree
((m0 + m1) + (m2 + m3)) + ... over the global index, in fp32 (fp64 for fp64 weights), then divided
by L. The low bits of the index are the rank, the high bits the micro-step, so the subtree of one
micro-step's W leaves is complete after that micro-step on every layout; where a node is computed
changes with the layout, its value does not:

- the routed experts at EP P: one backward mixes P sources (the P ranks of the EP group, which are
  consecutive ranks: the lowest log2(P) bits of the index), so their weight gradient is computed
  per (local expert, source) block (the tree hands the experts a store,
  ``LocalExperts.collect_source_grads``), which pairs the P blocks as each backward gives them:
  one partial per local expert waits for ``add_micro_batch``, whatever P;
- across ranks, from each ``add_micro_batch``, by recursive doubling: at step k group rank r adds
  the partial of rank r xor 2^k. The two partners hold the two halves of one tree node, and a + b
  is the same bits as b + a, so both hold the node. The experts join at step log2(P), where the
  partner holds the same experts. With ``overlap`` (the default) it runs while the next
  micro-batch computes; a large vector goes as a reduce-scatter by recursive halving and an
  all-gather, which add the same pairs and send fewer bytes (tree_exchange.py); the values are
  the same either way;
- over the micro-steps, on every rank alike: a stack of log2(A) partials (a binary counter).

So parameters, their gradients and the clipped norm are bitwise the same for every layout with the
same L (world size, EP size, expert-data-parallel size, A), given that each leaf is: the layer's
per-token contract (dropless, or the sync-free step within its capacity), micro-batches of equal
size, and row-stable expert GEMMs (docs/parallel.md has the promise and its limits).
"""
from __future__ import annotations

import functools
import hashlib
import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..distributed.agreement import agree_problems, differ
from ..distributed.comm import WeakGroup, all_gather_rows
from ..experts import LocalExperts, SourceGrads
from ..numerics.fixed_order import tree_sum
from ..router import TopKRouter
from .tree_exchange import TreeExchange
from .tree_partials import (
    PairedSourceGrads,
    ParameterPartials,
    accumulation_dtype,
    first_differences,
    pairwise_sum,
    push_views,
)


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


_REBUILD = ("which parameters train is fixed when the GradientTree is built: build a new GradientTree(model, ...) "
            "after changing requires_grad, a dtype or a parameter (this step's gradients are dropped)")
_ADD, _REDUCE = 1, 2  # which call a rank is in, in the calls' agreement
_CALLS = {_ADD: "add_micro_batch", _REDUCE: "reduce"}
_ORDER = ("the order of a step: loss.backward() and add_micro_batch() for each micro-batch, reduce(), "
          "clip_grad_norm_(), optimizer.step(), optimizer.zero_grad()")


class GradientTree:
    """Layout-invariant gradient accumulation, reduction and clipping (module docstring)::

        tree = GradientTree(model, micro_batches=A, group=None)
        for a in range(A):
            x = batch[tree.micro_batch_index(a)]  # global micro-batch a*W + r
            loss_fn(model(x)).backward()        # loss: the mean over this micro-batch's tokens
            tree.add_micro_batch()              # this micro-step's W leaves summed over group
        tree.reduce()                           # every .grad = the mean over the L micro-batches
        norm = tree.clip_grad_norm_(max_norm)
        optimizer.step(); optimizer.zero_grad()

    ``group``: the ranks whose data differ (None: the world; a single process without
    torch.distributed). Each `MoELayer`'s EP group must be a contiguous block of ``group``
    (group ranks g*P .. g*P+P-1, in order); the ranks with the same EP rank hold the same experts.
    The size of ``group`` and ``micro_batches`` must be powers of two. Collective over ``group``:
    every rank builds it at the same point; one small all-gather agrees on micro_batches and the
    trained parameters (names in the model, shapes, dtypes, order) and carries any refusal, so
    every rank raises the same ValueError. The parameters that train (``requires_grad``) are fixed
    here: `reduce` refuses, on every rank, a step after one was frozen, unfrozen, replaced or cast;
    build a new tree after changing them. From then on the sharded experts' weights get no
    ``.grad`` from backward: the tree hands each sharded `LocalExperts` a store
    (``collect_source_grads``), where their per-source gradients wait for `add_micro_batch`. Do not
    wrap the model in DistributedDataParallel or FSDP: the tree does their reduction. ``overlap``:
    each micro-step's exchange runs while the next micro-batch computes (tree_exchange.py), on a
    process group of group's ranks that the first tree over group makes; False: in its call.
    """

    def __init__(self, model: nn.Module, micro_batches: int, group: Optional[dist.ProcessGroup] = None,
                 overlap: bool = True) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        if group is not None and not distributed:
            raise ValueError("group given, but torch.distributed is not initialised")
        self._group = WeakGroup((group or dist.group.WORLD) if distributed else None)  # as the layers hold theirs
        self.world = dist.get_world_size(self.group) if distributed else 1
        self.rank = dist.get_rank(self.group) if distributed else 0
        if self.rank < 0:
            raise ValueError("group: this rank is not in it (every rank of group builds the GradientTree)")
        if not _power_of_two(self.world):  # the same on every rank of group
            raise ValueError(f"group: its size must be a power of two (1, 2, 4, ...), got {self.world} ranks")
        # Every refusal below is found locally and raised by _agree on every rank alike.
        problems: List[str] = []
        valid = isinstance(micro_batches, int) and not isinstance(micro_batches, bool) and _power_of_two(micro_batches)
        if not valid:
            problems.append(f"micro_batches must be a power of two >= 1 (1, 2, 4, ...), got {micro_batches!r}")
        self.micro_batches = micro_batches
        if not isinstance(overlap, bool):
            problems.append(f"overlap must be True or False, got {overlap!r}")
        self.model = model
        # The checks look at the layers' parts (routers, experts), whatever model holds them.
        for name, module in model.named_modules():
            if isinstance(module, TopKRouter):
                problems += [f"model.{name}: {why}; GradientTree needs each micro-batch's loss to be its own "
                             "(no layout-invariant gradient exists otherwise)"
                             for why in module.losses_across_micro_batches()]
        self._entries: List[ParameterPartials] = []
        seen: set = set()
        stores: List[Tuple[LocalExperts, SourceGrads]] = []  # handed to the sharded experts once the ranks agree
        for name, module in model.named_modules():
            store = None
            if isinstance(module, LocalExperts) and module.ep_group is not None:
                problems += self._experts_problems(name, module)
                store = PairedSourceGrads()
                stores.append((module, store))
            for pname, p in module.named_parameters(recurse=False):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    start = int(math.log2(dist.get_world_size(module.ep_group))) if store is not None else 0
                    qualname = f"{name}.{pname}" if name else pname
                    self._entries.append(ParameterPartials(p, store, pname, qualname, start))
        self._agree(problems[:1], micro_batches if valid else -1)  # the first: the others often repeat it per layer
        self._trained = {id(e.param) for e in self._entries}
        # the cross-rank exchange packs prefixes: the entries that join at step k come first
        self._entries.sort(key=lambda e: e.start)
        self._pieces = self._norm_pieces(model)
        for experts, store in stores:
            experts.collect_source_grads(store)
        self._added = 0
        self._reduced = False
        self._written: WeakIdKeyDictionary = WeakIdKeyDictionary()  # the .grad tensors reduce() wrote
        self._exchange = TreeExchange(self.group, self.world, self.rank, overlap is True)

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        """The data-parallel group the tree reduces over (None: one process)."""
        return self._group()

    # ---- checks (found locally, raised on every rank alike: before any other collective) --------

    def _experts_problems(self, name: str, experts: LocalExperts) -> List[str]:
        problems = []
        P = dist.get_world_size(experts.ep_group)
        first = self.rank // P * P
        ranks = dist.get_process_group_ranks(self.group)
        block = ranks[first:first + P]
        ep_ranks = dist.get_process_group_ranks(experts.ep_group)
        if self.world % P or ep_ranks != block:
            problems.append(
                f"model.{name}: its EP group (global ranks {ep_ranks}) must be the block of group ranks "
                f"{first}..{first + P - 1} (global ranks {block}, in that order): GradientTree needs the EP groups "
                "to be contiguous blocks of group"
            )
        return problems

    def _agree(self, problems: List[str], micro_batches: int) -> None:
        """ValueError on every rank alike if a rank found a problem, or unless every rank has the same
        micro_batches and trained parameters (their names in the model, shapes, dtypes, EP sizes, in
        model order): one fixed-size all-gather (``agree_problems``) before any other collective; a
        second only when they differ, to name the first parameter that differs on each rank."""
        description = [e.describe() for e in self._entries]
        digest = int.from_bytes(hashlib.blake2b("\n".join(description).encode(), digest_size=8).digest(), "little",
                                signed=True)
        rows = agree_problems(problems, self.group, self._exchange_device(), "GradientTree",
                              values=[micro_batches, len(description), digest])
        mismatch = []
        if len({row[0] for row in rows}) > 1:
            mismatch.append(f"micro_batches differs across group: {differ([row[0] for row in rows])}")
        if len({tuple(row[1:]) for row in rows}) > 1:
            gathered: list = [None] * self.world
            dist.all_gather_object(gathered, description, group=self.group)
            mismatch.append(first_differences(gathered))
        if mismatch:
            raise ValueError("GradientTree: the ranks of group must build it alike: " + "; ".join(mismatch))

    def _exchange_device(self) -> torch.device:
        """Where the agreements' small exchanges go: the host where group's backend takes CPU tensors
        (gloo, "cpu:gloo,cuda:nccl"), so that reading them waits for no queued device work; else
        the parameters' device (NCCL: one host synchronisation)."""
        if self.world == 1 or "gloo" in str(dist.get_backend(self.group)):
            return torch.device("cpu")
        if self._entries:
            return self._entries[0].param.device
        return torch.device("cuda", torch.cuda.current_device())

    def _device(self) -> torch.device:
        return self._entries[0].param.device if self._entries else torch.device("cpu")

    # ---- accumulation and reduction ------------------------------------------------------------
    def micro_batch_index(self, a: int) -> int:
        """The global micro-batch (0..L-1) this rank runs at its micro-step ``a``: a*W + r."""
        if not isinstance(a, int) or isinstance(a, bool) or not 0 <= a < self.micro_batches:
            raise ValueError(f"a must be a micro-step 0..{self.micro_batches - 1} (micro_batches), got {a!r}")
        return a * self.world + self.rank

    def add_micro_batch(self) -> None:
        """Take this micro-batch's gradients (each ``.grad``, then set to None; the experts'
        per-source gradients, paired in order) as leaves of the tree, sum the micro-step's W leaves
        over ``group`` in tree order and push that node on the stack (with ``overlap``, but
        for the step's last micro-batch: the exchange starts here and runs while the next
        micro-batch computes; the next call finishes it). Call after each micro-batch's backward.
        Collective over ``group``: first one small fixed-size all-gather, so that a misuse on one
        rank (a .grad reduce() wrote, a rank in another call) raises the same ValueError on every
        rank, and the step's gradients are dropped."""
        problems = []
        if self._added == self.micro_batches:
            problems.append(f"add_micro_batch: already {self.micro_batches} micro-batches (micro_batches) this "
                            "step; call reduce()")
        for e in self._entries:
            p = e.param
            if e.changed():  # reduce() refuses the step on every rank, naming it
                continue
            if p.grad is not None and p.grad in self._written:
                problems.append("add_micro_batch: a .grad is still the one reduce() wrote: call optimizer.zero_grad() "
                                "(set_to_none=True, the default) after each step")
                break
            if e.source_grads is not None and p.grad is not None:
                problems.append(f"add_micro_batch: the sharded expert weight {e.name} has a .grad; under a "
                                "GradientTree its gradient comes per source (LocalExperts.collect_source_grads), "
                                "which only an MoELayer's dispatch gives (experts called on their own do not)")
                break
        self._agree_call(problems, _ADD)
        self._exchange.finish()
        by_dtype: Dict[torch.dtype, List[Tuple[ParameterPartials, torch.Tensor]]] = {}
        for e in self._entries:  # in order: each dtype's entries keep the prefix order of their start
            acc = accumulation_dtype(e.dtype)  # as built: the same exchange on every rank
            p = e.param
            if e.changed():  # its place in the exchange stays, as zeros; reduce() refuses the step
                if e.source_grads is not None:
                    e.source_grads.take(e.name)
                node = torch.zeros(e.shape, dtype=acc, device=p.device)
            elif e.source_grads is None:
                node = p.grad.detach() if p.grad is not None else torch.zeros(p.shape, dtype=acc, device=p.device)
            else:
                node = self._source_node(e, acc)
            p.grad = None
            by_dtype.setdefault(acc, []).append((e, node))
        for acc, pairs in by_dtype.items():
            entries = [e for e, _ in pairs]
            flat = torch.cat([node.reshape(-1).to(acc) for _, node in pairs])  # the leaves, converted exactly
            del pairs
            prefix = [sum(e.shape.numel() for e in entries if e.start <= k) for k in range(self._exchange.steps)]
            self._exchange.start(flat, prefix, functools.partial(push_views, flat, entries, acc),
                                 at_once=self._added == self.micro_batches - 1)  # the last: reduce() is next
        self._added += 1
        self._reduced = False

    def _source_node(self, e: ParameterPartials, acc: torch.dtype) -> torch.Tensor:
        """[E_local, ...] in ``acc``: the micro-step's per-source gradients, already paired over the
        P sources in order as each backward gave them (`PairedSourceGrads`); zeros if none came."""
        grads = e.source_grads.take(e.name)
        if not grads:
            return torch.zeros(e.shape, dtype=acc, device=e.param.device)
        (node,) = grads
        return node.to(acc)

    def _agree_call(self, problems: List[str], call: int) -> None:
        """The fixed-size all-gather that starts `add_micro_batch` and `reduce`: every rank's local
        refusals, and which call at which micro-step it is in; a ValueError on every rank alike if a
        rank found a problem or the ranks are in different calls (the step's gradients dropped)."""
        try:
            rows = agree_problems(problems, self.group, self._exchange_device(), "GradientTree",
                                  values=[call, self._added])
            if len({tuple(row) for row in rows}) > 1:
                calls = [f"{_CALLS[c]} after {n} micro-batches" for c, n in rows]
                raise ValueError(f"GradientTree: the ranks of group are in different calls: {differ(calls)}; "
                                 f"every rank adds micro_batches={self.micro_batches} micro-batches, then reduces")
        except ValueError:
            self._drop()
            raise

    def _drop(self) -> None:
        """Forget this step's gradients: the partials, the exchange in flight, the .grad and source
        gradients not yet taken."""
        self._exchange.drop()
        for e in self._entries:
            e.stack = []
            if e.source_grads is not None:
                e.source_grads.take(e.name)
            if e.param.grad is not None and e.param.grad not in self._written:
                e.param.grad = None
        self._added = 0

    def reduce(self) -> None:
        """Set each ``.grad`` (a sharded expert weight's: its local shard) to the sum of the L leaves
        by the tree, divided by L. The cross-rank sums were done in `add_micro_batch`; this adds no
        exchange but the first, a small fixed-size all-gather (collective over ``group``): a rank
        that added other than micro_batches micro-batches, or whose trained parameters changed
        since the tree was built (frozen, unfrozen, another dtype or shape, replaced), makes every
        rank raise the same ValueError, naming it; the step's gradients are then dropped."""
        self._agree_call(self._step_problems(), _REDUCE)
        self._exchange.finish()
        L = self.world * self.micro_batches
        for e in self._entries:
            (_, partial), = e.stack
            e.stack = []
            e.param.grad = partial.div_(L).to(e.param.dtype)
            self._written[e.param.grad] = True
        self._added = 0
        self._reduced = True

    def _step_problems(self) -> List[str]:
        """What is wrong with this rank's step, found locally: the micro-batch count, and each
        parameter whose training changed since the tree was built."""
        problems = []
        if self._added != self.micro_batches:
            problems.append(f"reduce: {self._added} micro-batches were added this step, expected micro_batches="
                            f"{self.micro_batches}")
        changed = [c for c in (e.changed() for e in self._entries) if c]
        for name, p in self.model.named_parameters():
            if p.requires_grad and id(p) not in self._trained:
                changed.append(f"{name} is trained (requires_grad=True) but was not when the GradientTree was built "
                               "(unfrozen or replaced since)")
        if changed:
            problems.append("reduce: " + "; ".join(changed) + f"; {_REBUILD}")
        return problems

    # ---- the norm ------------------------------------------------------------------------------
    def _norm_pieces(self, model: nn.Module) -> List[Tuple[nn.Module, Optional[nn.Parameter]]]:
        """The canonical order of the norm's pieces: modules in order; a LocalExperts module is one
        item (its pieces are (expert id, parameter)), any other module's own trained parameters one each."""
        pieces, seen = [], set()
        for module in model.modules():
            if isinstance(module, LocalExperts):
                if any(p.requires_grad for p in (module.weight1, module.weight2)):
                    pieces.append((module, None))
                continue
            for p in module.parameters(recurse=False):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    pieces.append((module, p))
        return pieces

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The 2-norm of all gradients, as a fixed pairwise sum over the pieces (layer, expert id,
        parameter) whatever rank holds them, the same on every rank; scales every ``.grad`` by
        min(1, max_norm / (norm + 1e-6)) in place; returns the norm (a 0-dim tensor). Collective
        over ``group``; after `reduce` and before ``optimizer.zero_grad()``: a trained parameter
        without a ``.grad`` is a ValueError saying the order (found locally: a rank alone in that
        mistake raises alone, and its peers wait in the norm's all-gather)."""
        if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or not max_norm >= 0 or \
                math.isinf(max_norm):
            raise ValueError(f"max_norm must be a finite number >= 0, got {max_norm!r}")
        if not self._reduced:
            raise ValueError("clip_grad_norm_: call reduce() first (after the step's last add_micro_batch)")
        missing = [e.qualname for e in self._entries if e.param.grad is None]
        if missing:  # found locally: a rank alone in this leaves the others in the norm's all-gather
            raise ValueError(f"clip_grad_norm_: {missing[0]} has no .grad (optimizer.zero_grad() since reduce()?); "
                             f"{_ORDER}")
        device = self._device()
        acc = torch.float64 if any(e.param.dtype == torch.float64 for e in self._entries) else torch.float32
        values, holders = [], []
        for module, p in self._pieces:
            if p is not None:
                values.append(tree_sum(p.grad.detach().to(acc).reshape(-1).square(), 0).reshape(1))
                holders.append(0)
                continue
            held = module.num_local_experts
            ep = 1 if module.ep_group is None else dist.get_world_size(module.ep_group)
            trained = [w for w in (module.weight1, module.weight2) if w.requires_grad]
            mine = torch.zeros(held * ep, len(trained), dtype=acc, device=device)
            for j, w in enumerate(trained):
                sq = w.grad.detach().to(acc).reshape(held, -1).square()
                mine[module.local_expert_offset:module.local_expert_offset + held, j] = tree_sum(sq, 1)
            values.append(mine.reshape(-1))
            # expert i (global id) is held by the ranks of EP rank i // held; group rank i // held has it
            holders.extend(i // held for i in range(held * ep) for _ in trained)
        vec = torch.cat(values) if values else torch.zeros(0, dtype=acc, device=device)
        if self.world > 1:
            index = torch.tensor(holders, dtype=torch.int64, device=device)
            vec = all_gather_rows(vec.view(1, -1), self.group).gather(0, index.view(1, -1)).view(-1)
        norm = tree_sum(vec, 0).sqrt() if vec.numel() else torch.zeros((), dtype=acc, device=device)
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for e in self._entries:
            e.param.grad.mul_(scale)
        return norm

    def held_bytes(self) -> int:
        """Bytes of the partial sums this tree holds now (between micro-batches: up to log2(A) per
        parameter, a sharded expert weight's the size of its local shard, the last micro-step's
        node still in its overlapped exchange included; none after `reduce`)."""
        parts = self.held_bytes_by_part()
        return parts["partials"] + parts["in flight"]

    def held_bytes_by_part(self) -> Dict[str, int]:
        """`held_bytes` by part: "partials" (the stacks) and "in flight" (micro-step nodes in the
        overlapped exchange); beside them, "source blocks": the sharded experts' per-source
        gradients, paired over the sources as they came, that a backward left for the next
        `add_micro_batch` (not counted in `held_bytes`)."""
        stores = {id(e.source_grads): e.source_grads for e in self._entries if e.source_grads is not None}
        return {"partials": sum(t.numel() * t.element_size() for e in self._entries for _, t in e.stack),
                "in flight": self._exchange.held_bytes(),
                "source blocks": sum(store.held_bytes() for store in stores.values())}

    def source_grads_transient_bytes(self) -> int:
        """The largest per-source weight gradient ``[E_local, P, ...]`` (in the weights' dtype) that a
        sharded experts' backward handed to the tree since it was built: it lives inside that
        backward, beside what `held_bytes_by_part` counts, until the store pairs it (0 without
        sharded experts)."""
        return max((e.source_grads.largest_handed for e in self._entries
                    if isinstance(e.source_grads, PairedSourceGrads)), default=0)

    def exchange_totals(self) -> Tuple[float, int]:
        """(seconds, bytes) that this rank's cross-rank exchange has spent and sent since the tree
        was built: the wall time of its steps and the bytes of its sends."""
        return self._exchange.busy_seconds, self._exchange.sent_bytes

    def global_mean(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` [A] (e.g. this rank's micro-batch losses, detached) -> their mean over the L
        micro-batches by the same tree, the same on every rank (a 0-dim tensor). Collective."""
        if values.shape != (self.micro_batches,):
            raise ValueError(f"values must be [{self.micro_batches}] (micro_batches), got {list(values.shape)}")
        v = values.detach().to(accumulation_dtype(values.dtype)).contiguous()
        if self.world > 1:  # rank-major [W * A] -> by global index a*W + r
            v = all_gather_rows(v, self.group).view(self.world, self.micro_batches).t().reshape(-1)
        return pairwise_sum(v) / v.numel()

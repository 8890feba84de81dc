"""The process-wide tables of the dispatchers and of their collectives, in one place.

Each table is keyed by an EP process group (``comm.group_key``: None and the default group are one
key), sometimes with a second key, and lives for the process (an entry as long as its group): what
it holds belongs to the group, not to one object, because several objects (every layer's
dispatcher, the functional dispatch, the staged API's callers) run collectives on the same group
and must see the same state.

- ``LAYER_IDS`` (distributed/identity.py): group -> dispatchers built on it so far, the next
  layer id. A counter per group (not per model): every rank numbers its layers in construction
  order, whatever object builds them (``identity``'s assumption).
- ``FUNCTIONAL_STEPS`` (distributed/identity.py): group -> the functional dispatches'
  StepCounter. The functional API has no object to hold its forward count, and every call on a
  group must count on the same counter, as every rank does.
- ``LATCHES`` (distributed/agreement.py, ``GROUP_LATCHES.of``): group -> its ErrorLatch. An error
  latched by one step travels in the next size exchange on the group, whoever runs it (another
  layer, the functional API): one latch per group.
- ``SYNC_FREE_PLANS`` (dispatcher/sync_free/plan.py): (group, configuration fingerprint) -> what the first
  sync-free step fixed (its T, dtypes, device). Layers of one configuration on one group share
  the plan, so that a rebuilt layer or the functional API sends the same fixed-size chunks.
- ``SYNC_FREE_WORDS`` (dispatcher/sync_free/words.py): group -> [the bad steps' check words on the
  device, their sizes], read by the next sync-free dispatch on the group (CPU) and by
  ``ops.check_device_errors()``, which knows no group or layer.

Process-wide state elsewhere, kept where it lives (a module of its own concern):
- ops/guard.py: ``_status`` (device -> the sticky status words every kernel of ours reads: one
  per device, as kernels of any layer poison each other's outputs), ``_pending`` and
  ``_free_pinned`` (the permute checks still in flight, their pinned buffers), ``_checks`` (the
  deferred checks other modules register: sync_free.words' ``SYNC_FREE_WORDS`` reader).
- ops/custom_ops.py: ``_backend``, the kernel backend forced by ``set_backend`` (or the
  MOE_DISPATCH_BACKEND environment variable).
- checkpoint.py: ``_SHARDED``, ``_HOOKED``, ``_CHECKED`` (weak sets of the sharded expert
  modules, the optimizers hooked, and the optimizers' checked step), so that a save or load
  finds the expert weights of any model without a handle to it; weak: they keep nothing alive.
- parallel.py: ``_REDUCED`` (weak, gradient tensor -> its version when allreduce_expert_grads
  wrote it), to catch a second reduction of the same gradients.
- integrations/megatron: supported.py ``_WARNED`` (each unsupported-field warning once per
  process) and specs.py ``_CLASSES`` (the DeterministicMoELayer class, built on first use).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Generic, Hashable, Iterator, Optional, TypeVar

from .comm import ProcessGroup, group_key, weakly_referable

V = TypeVar("V")


class GroupTable(Generic[V]):
    """A process-wide table keyed by an EP group (None and the default group are one key) and
    an optional second key ``sub``.

    The table holds its groups weakly: a group's entries die with the group. A strong reference
    would keep a destroyed group (``destroy_process_group``) alive until interpreter exit, where
    gloo's worker threads are torn down after the runtime they need, and the process aborts
    ("terminate called without an active exception") after the user's code has finished."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._groups: "weakref.WeakKeyDictionary[Any, dict[Hashable, V]]" = weakref.WeakKeyDictionary()
        # Keys that take no weak reference, held strongly: None (torch.distributed not initialised,
        # one process) and the int torch's new_group returns to a rank outside the group.
        self._plain: dict[Any, dict[Hashable, V]] = {}

    def _entries(self, group: ProcessGroup, create: bool) -> Optional[dict[Hashable, V]]:
        key = group_key(group)
        table = self._groups if weakly_referable(key) else self._plain
        entries = table.get(key)
        if entries is None and create:
            entries = table[key] = {}
        return entries

    def get(self, group: ProcessGroup, sub: Hashable = None) -> Optional[V]:
        entries = self._entries(group, create=False)
        return None if entries is None else entries.get(sub)

    def set(self, group: ProcessGroup, value: V, sub: Hashable = None) -> V:
        self._entries(group, create=True)[sub] = value
        return value

    def setdefault(self, group: ProcessGroup, make: Callable[[], V], sub: Hashable = None) -> V:
        """The entry, made by ``make()`` if there is none."""
        entries = self._entries(group, create=True)
        if sub not in entries:
            entries[sub] = make()
        return entries[sub]

    def pop(self, group: ProcessGroup, sub: Hashable = None) -> Optional[V]:
        entries = self._entries(group, create=False)
        return None if entries is None else entries.pop(sub, None)

    def _all_entries(self) -> list[dict[Hashable, V]]:
        """Every group's entries (a snapshot: the weak table may lose a group meanwhile)."""
        return [*self._plain.values(), *list(self._groups.values())]

    def values(self) -> Iterator[V]:
        return iter([value for entries in self._all_entries() for value in entries.values()])

    def __repr__(self) -> str:
        return f"GroupTable({self.name!r}, {sum(len(e) for e in self._all_entries())} entries)"


# The tables of values whose classes live above this module (identity.StepCounter,
# agreement.ErrorLatch, the sync-free plan's record) hold Any here, so that this module imports
# nothing above it (not even for typing); each table's one accessor, named above, returns the type.
LAYER_IDS: GroupTable[int] = GroupTable("layer ids")
FUNCTIONAL_STEPS: GroupTable[Any] = GroupTable("functional steps")
LATCHES: GroupTable[Any] = GroupTable("error latches")
SYNC_FREE_PLANS: GroupTable[Any] = GroupTable("sync-free plans")
SYNC_FREE_WORDS: GroupTable[list] = GroupTable("sync-free check words")

TABLES = (LAYER_IDS, FUNCTIONAL_STEPS, LATCHES, SYNC_FREE_PLANS, SYNC_FREE_WORDS)

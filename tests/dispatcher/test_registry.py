"""The process-wide tables of the dispatchers (moe_dispatch.distributed.registry): the modules that
use them hold no table of their own, and each table is the one its users read and write."""
from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import torch

from moe_dispatch.dispatcher import AllToAllDispatcher, dispatch
from moe_dispatch.dispatcher.sync_free import plan as sync_free_plan
from moe_dispatch.dispatcher.sync_free import words as sync_free_words
from moe_dispatch.distributed import agreement, identity, registry

from .helpers import batch, config


def test_each_table_is_the_one_its_users_share():
    before = registry.LAYER_IDS.get(None) or 0
    first, second = AllToAllDispatcher(config()), AllToAllDispatcher(config())
    assert (first.layer_id, second.layer_id) == (before, before + 1)
    assert registry.LAYER_IDS.get(None) == before + 2
    assert first.latch is second.latch is registry.LATCHES.get(None) is agreement.GROUP_LATCHES.of(None)
    data = batch(torch.float32, n=8)
    dispatch(data["x"], data["rmap"], data["probs"], config())
    counter = registry.FUNCTIONAL_STEPS.get(None)
    assert counter is identity.functional_counter(None) and counter.steps >= 1


def test_the_users_hold_no_table_of_their_own():
    """Every GroupTable is registry's, and the tables that lived in these modules are gone."""
    for module in (sync_free_plan, sync_free_words, agreement, identity):
        for name, value in vars(module).items():
            assert not isinstance(value, registry.GroupTable) or value in registry.TABLES, (module.__name__, name)
    for module, name in ((sync_free_plan, "_AGREED"), (sync_free_words, "_LATCHED"), (identity, "_BUILT"),
                         (identity, "_FUNCTIONAL")):
        assert not hasattr(module, name), (module.__name__, name)
    for table in registry.TABLES:
        assert table.name and isinstance(table, registry.GroupTable)


def test_group_table_keys_none_and_a_second_key():
    table: registry.GroupTable[int] = registry.GroupTable("test")
    assert table.get(None) is None and table.setdefault(None, lambda: 3) == 3 and table.setdefault(None, int) == 3
    table.set(None, 5, sub="b")
    assert table.get(None, "b") == 5 and table.get(None) == 3
    assert sorted(table.values()) == [3, 5]
    assert table.pop(None, "b") == 5 and table.pop(None, "b") is None
    table.set(-100, 7)  # the int new_group returns outside the group takes no weak reference
    assert table.get(-100) == 7 and sorted(table.values()) == [3, 7]


def test_a_groups_entries_die_with_the_group():
    class Group:  # any object stands for a group: group_key passes a non-None group through
        pass

    table: registry.GroupTable[int] = registry.GroupTable("test")
    group = Group()
    table.set(group, 1)
    table.set(group, 2, sub="b")
    assert sorted(table.values()) == [1, 2] and table.get(group, "b") == 2
    del group
    gc.collect()
    assert list(table.values()) == []


DESTROYED_GROUP = """
import gc, sys, weakref
import torch, torch.distributed as dist
from moe_dispatch.dispatcher import AllToAllDispatcher, dispatch
from tests.dispatcher.helpers import batch, config
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
AllToAllDispatcher(config())  # LAYER_IDS and LATCHES now hold the default group
data = batch(torch.float32, n=8)
dispatch(data["x"], data["rmap"], data["probs"], config())  # and FUNCTIONAL_STEPS
world = weakref.ref(dist.group.WORLD)
dist.destroy_process_group()
gc.collect()
assert world() is None, "a destroyed process group is still alive"
"""


def test_the_tables_keep_no_destroyed_group_alive(tmp_path):
    """A table that held the default group past destroy_process_group kept gloo's threads until
    interpreter exit, where the process aborted after the user's code had finished (a docs
    snippet failed so in one run of three)."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", DESTROYED_GROUP, str(tmp_path / "store")], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]

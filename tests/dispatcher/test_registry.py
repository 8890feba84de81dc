"""The process-wide tables of the dispatchers (moe_dispatch.distributed.registry): the modules that
use them hold no table of their own, and each table is the one its users read and write."""
from __future__ import annotations

import torch

from moe_dispatch.dispatcher import AllToAllDispatcher, dispatch, static, static_words
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
    for module in (static, static_words, agreement, identity):
        for name, value in vars(module).items():
            assert not isinstance(value, registry.GroupTable) or value in registry.TABLES, (module.__name__, name)
    for module, name in ((static, "_AGREED"), (static_words, "_LATCHED"), (identity, "_BUILT"),
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

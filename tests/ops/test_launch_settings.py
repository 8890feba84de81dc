"""launch_settings: LAUNCH overrides that hold inside the block and are undone after it."""
import pytest

from moe_dispatch.ops import kernels as K


def test_overrides_inside_and_restores_after():
    before = dict(K.LAUNCH)
    with K.launch_settings(zero_only_uncovered=not before["zero_only_uncovered"], warps=8):
        assert K.LAUNCH["zero_only_uncovered"] is not before["zero_only_uncovered"]
        assert K.LAUNCH["warps"] == 8
        K.LAUNCH["slots_per_step"] = 1  # a change made inside the block is undone too
    assert K.LAUNCH == before


def test_restores_when_the_block_raises():
    before = dict(K.LAUNCH)
    with pytest.raises(RuntimeError, match="inside"):
        with K.launch_settings(group_columns_tiles=True):
            raise RuntimeError("inside")
    assert K.LAUNCH == before


def test_nested_blocks_restore_in_turn():
    before = dict(K.LAUNCH)
    with K.launch_settings(warps=4):
        with K.launch_settings(warps=16):
            assert K.LAUNCH["warps"] == 16
        assert K.LAUNCH["warps"] == 4
    assert K.LAUNCH == before


def test_unknown_name_raises_before_changing_anything():
    before = dict(K.LAUNCH)
    with pytest.raises(KeyError, match="wraps"):
        with K.launch_settings(warps=8, wraps=8):
            pass
    assert K.LAUNCH == before

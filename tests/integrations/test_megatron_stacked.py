"""install()'s stacked expert weights (megatron-core's MoELayer, SequentialMLP, no TE, EP 1 on one
CPU gloo rank; see megatron_stacked_worker.py): the expert GEMMs read the weights where they live
and return their gradients in the layout of .grad, with results bitwise equal to the stack-copy
path they replace; parameters, state dicts, optimizers and Megatron's DDP see what they saw."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.dispatcher.harness import run_ranks  # noqa: E402

from .megatron_stacked_worker import STEPS, stacked_worker  # noqa: E402
from .megatron_worker import DTYPES, assert_equal, assert_steps_equal  # noqa: E402

DTYPE_NAMES = tuple(DTYPES)  # the dtypes the worker ran


@pytest.fixture(scope="module")
def rank():
    return run_ranks(stacked_worker, 1, timeout=300)[0]



@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_fast_path_bitwise_equals_stack_copy_path(rank, dtype):
    rec = rank[dtype]["equivalence"]
    assert rec["stacked"] == (True, True)
    assert_steps_equal(rec["fast"], rec["old"], "fast vs stack copy", contiguous_expert_grads=True)
    assert sorted(rec["fast_acc"]) == sorted(rec["old_acc"])
    for name in rec["fast_acc"]:  # gradients accumulated over two passes
        assert_equal(rec["fast_acc"][name], rec["old_acc"][name], ("accumulated", name))
    # Weights moved out of the stack: the forward copies them, says so once, same bits.
    assert rec["unstacked"] == (False, False) and rec["copy_warnings"] == 1
    assert_steps_equal(rec["copied"], rec["old"], "copied vs stack copy", contiguous_expert_grads=True)
    # .to() gives every weight a new tensor: they are stacked again.
    assert rec["restacked"] == (True, True)
    assert_steps_equal(rec["after_restack"], rec["old"], "after restack", contiguous_expert_grads=True)


def test_install_keeps_parameter_objects(rank):
    rec = rank["parameters"]
    assert rec["before"] == rec["after"]  # names, object ids, shapes, dtypes, requires_grad
    assert rec["stacked"] == (True, True)
    before, after = rec["attrs"]
    assert before == after  # Megatron's attributes on each parameter (allreduce, ...)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_state_dict_round_trip(rank, dtype):
    rec = rank[dtype]["state_dicts"]
    assert list(rec["stock_sd"]) == list(rec["ours_sd"])
    for key in rec["stock_sd"]:
        if isinstance(rec["stock_sd"][key], torch.Tensor):
            assert_equal(rec["stock_sd"][key], rec["ours_sd"][key], ("stock -> ours", key))
    assert rec["stacked"] == (True, True)  # load_state_dict copied into the views
    assert_equal(rec["stack_fc1"], rec["stock_fc1"], "the stack holds the loaded weights")
    assert_steps_equal(rec["ours_out"], rec["ours_old_out"], "loaded weights, fast vs stack copy",
                       contiguous_expert_grads=True)
    assert list(rec["back_sd"]) == list(rec["ours_sd2"])
    for key in rec["back_sd"]:
        if isinstance(rec["back_sd"][key], torch.Tensor):
            assert_equal(rec["back_sd"][key], rec["ours_sd2"][key], ("ours -> stock", key))
    stock_sharded, ours_sharded = rec["sharded"]
    assert list(stock_sharded) == list(ours_sharded)
    assert any(key.endswith("linear_fc1.weight") for key in stock_sharded)
    for key, stock_entry in stock_sharded.items():
        ours_entry = ours_sharded[key]
        assert stock_entry[:-1] == ours_entry[:-1] if len(stock_entry) == 4 else stock_entry == ours_entry, key
        if len(stock_entry) == 4:
            assert_equal(stock_entry[3], ours_entry[3], ("sharded", key))


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_adam_trains_the_same_parameters(rank, dtype):
    rec = rank[dtype]["adam"]
    assert rec["fast_params"] == rec["old_params"] == rec["stock_params"]
    assert rec["fast_same_objects"] and rec["old_same_objects"]
    for step in range(STEPS):
        assert_equal(rec["fast"]["outs"][step], rec["old"]["outs"][step], ("out", step))
    assert step > 0 and not torch.equal(rec["fast"]["outs"][0], rec["fast"]["outs"][-1])  # it did train
    for name, value in rec["old"]["params"].items():
        assert_equal(rec["fast"]["params"][name], value, ("param after Adam", name))
    assert rec["fast"]["stacked"] == (True, True)  # the optimizer updated the views in place


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_megatron_ddp(rank, dtype):
    rec = rank[dtype]["ddp"]
    # Without the distributed optimizer DDP leaves the weights in place: fast path, no warning.
    # With it DDP moves them into its buffer (reverse order, fc1 / fc2 interleaved): copied, warned.
    assert rec[False]["stacked"] == (True, True) and not rec[False]["warned"]
    assert rec[True]["stacked"] == (False, False) and rec[True]["warned"]
    for dist_opt in (False, True):
        got = rec[dist_opt]
        assert_equal(got["out"], rec["plain"]["out"], (dist_opt, "out"))
        assert_equal(got["gx"], rec["plain"]["gx"], (dist_opt, "gx"))
        assert sorted(got["main_grads"]) == sorted(rec["plain_grads"])
        for name, grad in rec["plain_grads"].items():
            assert_equal(got["main_grads"][name].to(grad.dtype), grad, (dist_opt, "main_grad", name))

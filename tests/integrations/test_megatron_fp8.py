"""install(layer, fp8="e4m3"): megatron-core 0.16.1's MoELayer (SequentialMLP, no TE; hidden 64,
ffn 32, 8 experts, top-2, fp32 router, fp32 and bf16 params) dispatching FP8 rows with per-row
scales to row-stable FP8 experts, on 2 CPU gloo ranks (one spawn, megatron_fp8_worker.py).

- bitwise equal to our MoELayer(MoEConfig(fp8="e4m3")) with the same weights, at EP 2 and EP 1:
  outputs, input gradients and every expert's fc1 / fc2 weight gradients;
- bitwise across our two dispatchers and across EP sizes (EP 1 vs EP 2 on the same global batch);
- FP8 really on: the experts get the wire rows, and the results differ from fp8=None by a median
  per-token relative error inside [1e-2, 0.2];
- sync-free at EP 1 (``install(fp8=..., sync_free=True)``, and by default under CUDA graphs of the
  whole layer): bitwise the dropless dispatch's step;
- bad values raise MoEConfig's own ValueError before any collective; unsupported settings
  (Megatron's TE FP8, Megatron's experts, sizes, sync-free at EP 2) raise naming the setting;
- ``TransformerConfig.fp8_wgrad=False`` (``--no-fp8-wgrad``): the expert weight gradients in the
  tokens' dtype, bitwise our layer's with ``MoEConfig(fp8_wgrad=False)`` and across the dispatchers;
- ``install(fp8=..., quantize_weights_once=True)``: bitwise per-forward quantisation over two
  micro-batches, an optimizer step, an in-place weight change and a write through ``.data``,
  quantising once per phase;
  refused without fp8 or with a non-bool;
- on CUDA (``-m gpu``, sm90+: torch._scaled_grouped_mm), EP 1, bf16: bitwise equal to our FP8
  layer, and across the dispatchers.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from moe_dispatch import MoEConfig  # noqa: E402
from moe_dispatch.dispatcher import wire_width  # noqa: E402
from tests.dispatcher.harness import run_ranks  # noqa: E402

from .megatron_fp8_worker import BAD_VALUES, H, fp8_worker, gpu_fp8_worker  # noqa: E402
from .megatron_worker import DTYPES, KINDS, assert_equal  # noqa: E402

CASES = [(d, k) for d in DTYPES for k in KINDS]
IDS = ["-".join(c) for c in CASES]


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(fp8_worker, 2, timeout=300)


def _assert_experts_equal(a: dict, b: dict, what) -> None:
    assert sorted(a) == sorted(b) and a, (what, sorted(a), sorted(b))
    for e in a:
        for i in range(2):
            assert_equal(a[e][i], b[e][i], (what, "expert", e, "fc1" if i == 0 else "fc2"))


def _all_experts(ranks, case, step) -> dict:
    out = {}
    for rank in ranks:
        out.update(rank[case][step]["experts"])
    return out


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_equals_our_fp8_layer(ranks, case):
    for r, rank in enumerate(ranks):
        for ep in ("ep2", "ep1"):
            megatron, ours = rank[case][f"megatron_{ep}"], rank[case][f"ours_{ep}"]
            for field in ("out", "gx"):
                assert_equal(megatron[field], ours[field], (case, r, ep, field))
            _assert_experts_equal(megatron["experts"], ours["experts"], (case, r, ep))
    assert sorted(_all_experts(ranks, case, "megatron_ep2")) == list(range(8))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_bitwise_across_dispatchers(ranks, dtype):
    ag, a2a = (dtype, "allgather"), (dtype, "alltoall")
    for r, rank in enumerate(ranks):
        for step in ("megatron_ep2", "megatron_ep1"):
            for field in ("out", "gx"):
                assert_equal(rank[ag][step][field], rank[a2a][step][field], (dtype, r, step, field))
            _assert_experts_equal(rank[ag][step]["experts"], rank[a2a][step]["experts"], (dtype, r, step))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_no_fp8_wgrad(ranks, case):
    """TransformerConfig.fp8_wgrad=False (Megatron's --no-fp8-wgrad) at EP 2: the output and input
    gradient bitwise those of FP8 wgrad, the expert weight gradients changed, bitwise our layer's
    (moe_config_from_megatron carries the field) and across the dispatchers."""
    other = (case[0], "allgather" if case[1] == "alltoall" else "alltoall")
    for r, rank in enumerate(ranks):
        wide, fp8 = rank[case]["megatron_ep2_wide_wgrad"], rank[case]["megatron_ep2"]
        for field in ("out", "gx"):
            assert_equal(wide[field], fp8[field], (case, r, field))
        assert all(not torch.equal(wide["experts"][e][0], fp8["experts"][e][0]) for e in wide["experts"])
        _assert_experts_equal(wide["experts"], rank[case]["ours_ep2_wide_wgrad"]["experts"], (case, r, "ours"))
        _assert_experts_equal(wide["experts"], rank[other]["megatron_ep2_wide_wgrad"]["experts"], (case, r, "kinds"))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_sync_free_bitwise_dropless(ranks, case):
    """install(fp8=..., sync_free=True) at EP 1: the sync-free plan's device counts and trailing rows
    give bitwise the dropless step (outputs, input gradients, every expert's weight gradients)."""
    for r, rank in enumerate(ranks):
        synced, dropless = rank[case]["megatron_ep1_sync_free"], rank[case]["megatron_ep1"]
        for field in ("out", "gx"):
            assert_equal(synced[field], dropless[field], (case, r, field))
        _assert_experts_equal(synced["experts"], dropless["experts"], (case, r))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bitwise_across_ep_sizes(ranks, case):
    """EP 1 (each rank alone, all 64 tokens) vs EP 2 (32 tokens per rank), same global batch."""
    for field in ("out", "gx"):
        ep2 = torch.cat([rank[case]["megatron_ep2"][field] for rank in ranks])
        for r, rank in enumerate(ranks):
            assert_equal(rank[case]["megatron_ep1"][field], ep2, (case, r, field))
    for rank in ranks:
        _assert_experts_equal(rank[case]["megatron_ep1"]["experts"], _all_experts(ranks, case, "megatron_ep2"), case)


def _median_row_error(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return ((got - ref).norm(dim=1) / ref.norm(dim=1)).median().item()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fp8_is_really_on(ranks, case):
    for r, rank in enumerate(ranks):
        fp8, plain = rank[case]["megatron_ep2"], rank[case]["megatron_bf16_wire"]
        assert (fp8["wire_fp8"], fp8["rows"]) == ("e4m3", ("torch.bfloat16", wire_width(H))), (case, r)
        assert (plain["wire_fp8"], plain["rows"]) == (None, (str(DTYPES[case[0]]), H)), (case, r)
        for field in ("out", "gx"):
            err = _median_row_error(plain[field], fp8[field])
            assert 1e-2 <= err <= 0.2, (case, r, field, err)
        for e in plain["experts"]:
            for i in range(2):
                err = _median_row_error(plain["experts"][e][i], fp8["experts"][e][i])
                assert 1e-2 <= err <= 0.2, (case, r, "expert", e, i, err)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_quantize_weights_once_bitwise_per_forward(ranks, dtype):
    """The kept operands serve both micro-batches (one quantisation: the two weights, 2 calls), are
    quantised again after an optimizer step, after copy_ into a weight and after a write autograd
    does not count (p.data.copy_: the weights' bits against the fingerprint kept with the operands,
    #46 item 2), and every result is bitwise the per-forward layer's. That the count would change:
    a kept layer that never re-quantised would differ after the step (SGD moved every weight)."""
    for r, rank in enumerate(ranks):
        phases = rank[(dtype, "alltoall")]["quantised_once"]
        assert list(phases) == ["micro-batches 1 and 2", "after an optimizer step", "after copy_ into a weight",
                                "after p.data.copy_ into a weight"]
        for phase, got in phases.items():
            assert got == dict(same=True, grads_same=True, quantised=2), (dtype, r, phase, got)


def _moe_config_error(value) -> str:
    with pytest.raises(ValueError) as info:
        MoEConfig(hidden_size=64, num_experts=8, topk=2, ffn_hidden_size=32, fp8=value)
    return str(info.value)


def test_bad_values_raise_moe_configs_error_before_any_collective(ranks):
    for r, rank in enumerate(ranks):
        for value in BAD_VALUES:
            assert rank["errors"][("value", value)] == ("ValueError", _moe_config_error(value)), (r, value)
    # rank 0 alone called install on the EP-2 layer (rank 1 waited in a barrier): no collective ran
    assert ranks[0]["errors"]["rank0_alone"] == ("ValueError", _moe_config_error("e5m2"))


def test_unsupported_settings_name_the_setting(ranks):
    expect = {
        "once_without_fp8": "install(quantize_weights_once=True) needs fp8",
        "once_not_bool": "quantize_weights_once must be True or False, got 1",
        "row_stable_gemms": "needs row_stable_gemms=True",
        "sync_free": "the layer's EP group has size 2",
        "ffn": "needs moe_ffn_hidden_size a multiple of 16",
        "hidden": "needs hidden_size a multiple of 16",
        "te_fp8_param": "fp8_param=True is not supported: TransformerEngine keeps the weights themselves in FP8",
    }
    for r, rank in enumerate(ranks):
        errors = rank["errors"]
        for key, text in expect.items():
            kind, message = errors[key]
            assert kind == "ValueError" and text in message, (r, key, errors[key])
        # TE's FP8 recipe in the config (fp8='hybrid') stays on the dense layers: accepted, with ours or without
        assert errors["te_fp8"] == errors["te_fp8_and_ours"] == ("ok", ""), (r, errors["te_fp8"])
        assert errors["cuda_graphs"] == ("ok", "") and errors["cuda_graphs_sync_free"], r
        assert errors["none_after_fp8"] == ("ok", "")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_equals_our_fp8_layer():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the FP8 expert GEMMs (torch._scaled_grouped_mm) need sm90+")
    results = run_ranks(gpu_fp8_worker, 1, timeout=300, backend="nccl")[0]
    for kind, rec in results.items():
        assert rec["megatron"]["rows"] == ("torch.bfloat16", wire_width(H)), kind
        for field in ("out", "gx"):
            assert_equal(rec["megatron"][field], rec["ours"][field], (kind, field))
        _assert_experts_equal(rec["megatron"]["experts"], rec["ours"]["experts"], kind)
        for phase, got in rec["quantised_once"].items():  # the kept weight operands, as on the CPU
            assert got == dict(same=True, grads_same=True, quantised=2), (kind, phase, got)
        wide = rec["megatron_wide_wgrad"]  # fp8_wgrad=False: same rows, other expert weight gradients
        for field in ("out", "gx"):
            assert_equal(wide[field], rec["megatron"][field], (kind, "wide", field))
        _assert_experts_equal(wide["experts"], rec["ours_wide_wgrad"]["experts"], (kind, "wide"))
        assert not torch.equal(wide["experts"][0][0], rec["megatron"]["experts"][0][0]), kind
    _assert_experts_equal(results["allgather"]["megatron_wide_wgrad"]["experts"],
                          results["alltoall"]["megatron_wide_wgrad"]["experts"], "dispatchers, wide")
    ag, a2a = results["allgather"]["megatron"], results["alltoall"]["megatron"]
    for field in ("out", "gx"):
        assert_equal(ag[field], a2a[field], ("dispatchers", field))
    _assert_experts_equal(ag["experts"], a2a["experts"], "dispatchers")

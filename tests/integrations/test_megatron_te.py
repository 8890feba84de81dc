"""install() on megatron-core's MoELayer with TransformerEngine's expert layouts, on CPU: the
experts are STAND-INS with TE's parameter layout (TEGroupedMLP: ``linear_fcX.weight0`` ..
``weight{El-1}`` [out, in]; SequentialMLP with TE linears), since TE cannot be installed here (see
megatron_te_worker.py). One gloo rank, EP 1, fp32 and bf16, both dispatchers; plus a config with
TE's FP8 recipe, the fusion flags and the refusals. The GPU counterpart with real TE runs Megatron-LM's
own pretrain_gpt.py: scripts/megatron/pretrain_routes.sh."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.dispatcher.harness import run_ranks  # noqa: E402

from .megatron_te_worker import te_worker  # noqa: E402
from .megatron_worker import KINDS, assert_equal  # noqa: E402

CASES = [(d, k) for d in ("fp32", "bf16") for k in KINDS]


@pytest.fixture(scope="module")
def result():
    return run_ranks(te_worker, 1, timeout=240)[0]


def _assert_steps_equal(a: dict, b: dict, what) -> None:
    for field in ("out", "gx", "router"):
        assert_equal(a[field], b[field], (what, field))
    assert len(a["experts"]) == len(b["experts"]) == 16
    for i, (u, v) in enumerate(zip(a["experts"], b["experts"])):
        assert_equal(u, v, (what, "expert weight grad", i))


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_te_grouped_experts_equal_sequential_bitwise(result, case):
    """Our layer over TEGroupedMLP's weight0..weight7 is our layer over SequentialMLP with the same
    weights, bitwise (output, input, router and every expert weight gradient); so is SequentialMLP
    with TE linears."""
    rec = result[case]
    _assert_steps_equal(rec["ours"], rec["sequential"], (case, "TEGroupedMLP"))
    _assert_steps_equal(rec["te_linears"], rec["sequential_seeded"], (case, "TE linears"))


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_install_keeps_state_dict_parameters_and_adam_state(result, case):
    """Same state-dict keys and values, the very Parameter objects, Adam's state unchanged; the
    weights become views of one stacked storage (no copy per forward, no warning), which stays so
    through an optimizer step; a checkpoint of stock (TE) loads into ours and back bitwise."""
    rec = result[case]
    assert rec["same_keys"] and rec["same_parameters"] and rec["same_values"] and rec["same_adam"], case
    assert rec["stacked"] and rec["stacked_after_step"] and rec["moved"], case
    assert rec["copy_warnings"] == [], rec["copy_warnings"]
    assert rec["round_trip"] and rec["round_trip_stacked"], case


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_fusion_flags_accepted_and_replaced(result, case):
    """moe_permute_fusion and moe_router_fusion: stock Megatron needs TE's fused kernels for them
    (here it raises); ours replaces both and its step is bitwise the unfused step. The layer's
    config keeps the flags; only its router's own copy has moe_router_fusion off."""
    rec = result[case]
    assert "fused" in rec["stock_fused"], rec["stock_fused"]
    _assert_steps_equal(rec["fused"], rec["unfused"], (case, "fused flags"))
    assert rec["fused_config_kept"]


def test_log_lines_once(result):
    """install() logs its route and the accepted flags, each once per process however many layers
    it installs (here 6 per dispatcher with the fusion flags on 2 of them)."""
    log = result["log"]
    for kind in KINDS:
        route = [m for m in log if m.startswith("moe_dispatch: install() on Megatron's MoELayer: our " + kind)
                 and "TEGroupedMLP expert GEMMs" in m and "tokens' dtype" in m]
        assert len(route) == 1, log
    fused = [m for m in log if m.startswith("moe_dispatch: accepted moe_permute_fusion=True")]
    assert len(fused) == 1 and "moe_router_fusion=True" in fused[0], log
    te_fp8 = [m for m in log if "fp8='hybrid' (TransformerEngine" in m]
    assert len(te_fp8) == 2 and any("our per-token FP8 (e4m3)" in m for m in te_fp8), log


def test_te_fp8_recipe_in_config_runs_moe_in_bf16_or_ours(result):
    """fp8='hybrid' in the config (TE's recipe, for the dense layers): the MoE layer's step is
    bitwise that without it, in bf16 and with install(fp8='e4m3')."""
    rec = result["fp8"]
    _assert_steps_equal(rec["te_fp8"], rec["plain"], "bf16")
    _assert_steps_equal(rec["te_fp8_ours_fp8"], rec["plain_ours_fp8"], "ours e4m3")
    assert not torch.equal(rec["plain"]["out"], rec["plain_ours_fp8"]["out"])


def test_refusals_name_the_setting_and_reason(result):
    errors = result["fp8"]["errors"]
    expect = {
        "fp8_param": "fp8_param=True is not supported: TransformerEngine keeps the weights themselves in FP8",
        "delay_wgrad": "delay_wgrad_compute=True is not supported",
        "glu_interleave": "moe_mlp_glu_interleave_size=32 interleaves the GLU halves",
        "single_grouped_weight": "one grouped 'weight' parameter (moe_single_grouped_weight=True)",
        "fp8_weights": "TEGroupedMLP linear_fc1.weight3 is _Float8StandIn",
    }
    for key, text in expect.items():
        kind, message = errors[key]
        assert kind == "ValueError" and text in message, (key, errors[key])

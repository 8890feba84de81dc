"""The Megatron plug-in: megatron-core 0.16.1's MoELayer (SequentialMLP, no TE; hidden 64, ffn 32,
8 experts, top-2, fp32 and bf16 params, fp32 router unless said) with our dispatcher installed,
on 2 CPU gloo ranks (one spawn, see megatron_worker.py for the set-up).

What these tests prove, on CPU:
- equality with Megatron's own dispatchers on the same layer and tokens (outputs, input grads,
  expert and router weight grads). With top-2 this is bitwise, not just within rounding: both sides
  add the same two expert outputs (and the same two gradient rows) and round once, and a + b is
  commutative. The one difference allowed is a bf16 router's (moe_router_dtype=None) input grads,
  where Megatron computes the probs gradient in bf16 and ours in fp32;
- bitwise invariance with ours installed: across ranks (identical tokens on both ranks), across
  dispatchers (allgather vs alltoall), across EP sizes (EP 1 vs EP 2 on the same global batch,
  outputs, input grads and expert weight grads), and under truncation (tokens 90+ of each rank
  zeroed: tokens 0-89 keep their outputs and input grads).
  These hold only because Megatron's own parts are row-stable here too: its experts do one
  ``mm`` per expert (CPU bf16 mm is row-stable; CPU fp32 mm only from 8 rows on, so the fp32
  cases assert that every expert got >= 8 rows), and its router's fp32 gating GEMM gave the same
  rows at M = 128 and M = 256 on this CPU. On CPU, Megatron's stock layer passes these checks too
  (BENCHMARKS.md); the mismatch the dispatcher removes shows on GPUs.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.dispatcher.harness import run_ranks  # noqa: E402

from .megatron_worker import DTYPES, KINDS, TRUNC, assert_equal, plugin_worker  # noqa: E402

CASES = [(d, k) for d in DTYPES for k in KINDS]
FIELDS = ("out", "gx", "router")


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(plugin_worker, 2, timeout=240)


def _experts(ranks, case, step) -> dict:
    """global expert id -> (fc1 grad, fc2 grad), over both ranks' local experts."""
    out = {}
    for rank in ranks:
        out.update(rank[case][step]["experts"])
    return out


def _assert_equal(a: torch.Tensor, b: torch.Tensor, what) -> None:
    assert torch.equal(a, b), (what, (a.double() - b.double()).abs().max().item())


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_equals_megatron_dispatcher(ranks, case):
    for r, rank in enumerate(ranks):
        for field in FIELDS:
            _assert_equal(rank[case]["stock"][field], rank[case]["ours"][field], (case, r, field))
    stock, ours = _experts(ranks, case, "stock"), _experts(ranks, case, "ours")
    assert sorted(ours) == list(range(8))
    for e in ours:
        for i in range(2):
            _assert_equal(stock[e][i], ours[e][i], (case, "expert", e, i))


def _rel_err(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return float((ref - got).abs().max() / ref.abs().max())


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_replaced_token_dispatcher_applies_probs_once(ranks, case):
    """Megatron's MoELayer with ``layer.token_dispatcher = dispatcher_from_megatron(config, pg)``
    equals stock Megatron within rounding (outputs, input, router and expert weight grads). The
    negative control, our combine-side probs under Megatron's experts, applies them twice."""
    for r, rank in enumerate(ranks):
        rec = rank[case]
        for field in FIELDS:
            _close(rec["stock"][field], rec["replaced"][field], case[0], (case, r, field))
        assert _rel_err(rec["stock"]["out"], rec["twice"]["out"]) > 0.1, (case, r)
    stock, replaced = _experts(ranks, case, "stock"), _experts(ranks, case, "replaced")
    for e in stock:
        for i in range(2):
            _close(stock[e][i], replaced[e][i], case[0], (case, "expert", e, i))


EXTRA = ("router-bf16", "router-fp64", "capacity-pad")


@pytest.mark.parametrize("name", EXTRA)
def test_equals_megatron_dispatcher_extra(ranks, name):
    """alltoall, bf16: a bf16 router (moe_router_dtype=None: probs arrive in bf16), an fp64 router,
    and moe_pad_expert_input_to_capacity (capacity factor 1)."""
    for r, rank in enumerate(ranks):
        rec = rank["extra"][name]
        _assert_equal(rec["stock"]["out"], rec["ours"]["out"], (name, r, "out"))
        if name == "router-bf16":
            # Megatron: d(probs) in bf16; ours: in fp32, rounded once to bf16 when it reaches the
            # router. The softmax backward then amplifies that rounding (it subtracts sum p dp).
            ref, got = rec["stock"]["gx"].double(), rec["ours"]["gx"].double()
            bound = 2.0 ** -5 * ref.abs().amax(1, keepdim=True)
            assert bool(((ref - got).abs() <= bound).all()), (name, r, ((ref - got).abs() / bound).max().item())
        else:
            _assert_equal(rec["stock"]["gx"], rec["ours"]["gx"], (name, r, "gx"))


def test_probs_reach_the_experts_in_fp32(ranks):
    for case in CASES:
        for step in ("ours", "trunc", "same", "ep1"):
            assert ranks[0][case][step]["probs_dtype"] == "torch.float32", (case, step)
    # A bf16 router: Megatron's dispatcher hands the experts bf16 probs; ours upcasts before sending.
    rec = ranks[0]["extra"]["router-bf16"]
    assert (rec["stock"]["probs_dtype"], rec["ours"]["probs_dtype"]) == ("torch.bfloat16", "torch.float32")
    rec = ranks[0]["extra"]["router-fp64"]  # an fp64 router keeps fp64 probs on both sides
    assert (rec["stock"]["probs_dtype"], rec["ours"]["probs_dtype"]) == ("torch.float64", "torch.float64")


def test_bitwise_across_ranks(ranks):
    """Identical tokens on both ranks: identical outputs and input grads."""
    steps = [(case, lambda rank, case=case: rank[case]["same"]) for case in CASES]
    steps += [(name, lambda rank, name=name: rank["extra"][name]["same"]) for name in EXTRA]
    for case, get in steps:
        for field in ("out", "gx"):
            _assert_equal(get(ranks[0])[field], get(ranks[1])[field], (case, field))
    # Rank 0's "same" batch is its own share of the full batch: same results as in that batch.
    for case in CASES:
        for field in ("out", "gx"):
            _assert_equal(ranks[0][case]["same"][field], ranks[0][case]["ours"][field], (case, field))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_bitwise_across_dispatchers(ranks, dtype):
    ag, a2a = (dtype, "allgather"), (dtype, "alltoall")
    for rank in ranks:
        for step in ("ours", "trunc", "same", "ep1"):
            for field in FIELDS:
                _assert_equal(rank[ag][step][field], rank[a2a][step][field], (dtype, step, field))
    for step in ("ours", "ep1"):
        one, two = _experts(ranks, ag, step), _experts(ranks, a2a, step)
        for e in one:
            for i in range(2):
                _assert_equal(one[e][i], two[e][i], (dtype, step, "expert", e, i))


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_bitwise_across_ep_sizes(ranks, case):
    """EP 1 (each rank alone, all 256 tokens) vs EP 2 (128 tokens per rank), same global batch."""
    for field in ("out", "gx"):
        ep2 = torch.cat([rank[case]["ours"][field] for rank in ranks])
        for rank in ranks:
            _assert_equal(rank[case]["ep1"][field], ep2, (case, field))
    # Each expert sees its rows in global token order at both EP sizes: the same weight GEMMs.
    ep1, ep2 = ranks[0][case]["ep1"]["experts"], _experts(ranks, case, "ours")
    for e in ep2:
        for i in range(2):
            _assert_equal(ep1[e][i], ep2[e][i], (case, "expert", e, i))
    if case[0] == "fp32":
        assert all(rank[case][s]["min_rows"] >= 8 for rank in ranks for s in ("ours", "ep1"))


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_truncation_keeps_first_tokens(ranks, case):
    for r, rank in enumerate(ranks):
        for field in ("out", "gx"):
            _assert_equal(rank[case]["trunc"][field][:TRUNC], rank[case]["ours"][field][:TRUNC], (case, r, field))
        if case[0] == "fp32":  # CPU fp32 mm is row-stable from 8 rows on (tests/experts/test_row_stability.py)
            assert rank[case]["trunc"]["min_rows"] >= 8 and rank[case]["ours"]["min_rows"] >= 8


def test_install_errors_and_spec_helper(ranks):
    extra = ranks[0]["extra"]
    expect = {
        "flex": "moe_token_dispatcher_type='flex'",
        "etp_config": "expert_tensor_parallel_size=2, expected 1",
        "etp_groups": "pg_collection.expt_tp has size 2, expected 1",
        "ep_mismatch": "EP group mismatch",
        "shared_overlap": "moe_shared_expert_overlap=True",
        "not_sequential": "row_stable_gemms needs SequentialMLP or TEGroupedMLP experts, got NoneType",
        "silu_not_gated": "activation_func=silu with gated_linear_unit=False is not supported",
    }
    for key, text in expect.items():
        kind, message = extra[key]
        assert kind == "ValueError" and text in message, (key, extra[key])
    assert extra["gpt_spec_mlp"] == "DeterministicMoELayer"


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_spec_fp8_equals_install_fp8(ranks, case):
    """get_moe_module_spec(..., fp8="e4m3") builds layers running our FP8 (their dispatcher's config
    says so; the default stays None) whose step is bitwise that of a stock layer with
    install(layer, fp8="e4m3"), same weights and tokens, EP 2: output, input, router and expert
    weight gradients."""
    for r, rank in enumerate(ranks):
        rec = rank["spec_fp8"][case]
        assert (rec["spec_class"], rec["spec_fp8"], rec["default_fp8"]) == ("DeterministicMoELayer", "e4m3", None)
        for field in FIELDS:
            assert_equal(rec["spec"][field], rec["install"][field], (case, r, field))
        assert sorted(rec["spec"]["experts"]) == sorted(rec["install"]["experts"]) == list(range(4 * r, 4 * r + 4))
        for e, grads in rec["spec"]["experts"].items():
            for i in range(2):
                assert_equal(grads[i], rec["install"]["experts"][e][i], (case, r, "expert", e, i))


def test_spec_fp8_bad_values_name_fp8(ranks):
    errors = ranks[0]["spec_fp8"]["errors"]
    expect = {"get_moe_module_spec": "get_moe_module_spec: fp8='e5m2' is not one of ('e4m3',)",
              "deterministic_moe_spec": "deterministic_moe_spec: fp8='E4M3' is not one of ('e4m3',)",
              "class": "fp8='e5m2' is not one of ('e4m3',)",
              "class_hidden": "install(fp8='e4m3') needs hidden_size a multiple of 16",
              "get_moe_module_spec_once": "install(quantize_weights_once=True) needs fp8",
              "deterministic_moe_spec_once": "quantize_weights_once must be True or False, got 'yes'",
              "class_once": "install(quantize_weights_once=True) needs fp8"}
    for key, text in expect.items():
        kind, message = errors[key]
        assert kind == "ValueError" and text in message, (key, errors[key])
    assert ranks[0]["spec_fp8"]["class_once_passed_on"] is True  # the class hands it on to install


# --- install(row_stable_gemms=True), the default: Megatron's GEMMs swapped for row-stable ones ---
def _close(ref: torch.Tensor, got: torch.Tensor, dtype: str, what) -> None:
    """Within rounding of Megatron's own GEMMs: a few units of the dtype's epsilon, row-scaled."""
    eps = {"fp32": 2.0 ** -23, "bf16": 2.0 ** -8}[dtype]
    ref, got = ref.double(), got.double()
    bound = 64 * eps * ref.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    assert bool(((ref - got).abs() <= bound).all()), (what, ((ref - got).abs() / bound).max().item())


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_row_stable_gemms_close_to_megatron(ranks, case):
    for r, rank in enumerate(ranks):
        rec = rank["row_stable"][case]
        for field in ("out", "gx"):
            _close(rec["stock"][field], rec["ours"][field], case[0], (case, r, field))


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_row_stable_gemms_bitwise_contract(ranks, case):
    """EP 1 vs EP 2, truncation, one token alone vs in its batch: bitwise, no row-count caveat
    (here fp32 experts get fewer than 8 rows when a token is alone)."""
    recs = [rank["row_stable"][case] for rank in ranks]
    for field in ("out", "gx"):
        ep2 = torch.cat([rec["ours"][field] for rec in recs])
        for r, rec in enumerate(recs):
            _assert_equal(rec["ep1"][field], ep2, (case, r, field, "ep"))
            _assert_equal(rec["trunc"][field][:TRUNC], rec["ours"][field][:TRUNC], (case, r, field, "trunc"))
            _assert_equal(rec["alone"][field], rec["ours"][field][:2], (case, r, field, "alone"))
    ep1, ep2 = recs[0]["ep1"]["experts"], {}
    for rec in recs:
        ep2.update(rec["ours"]["experts"])
    for e in ep2:
        for i in range(2):
            _assert_equal(ep1[e][i], ep2[e][i], (case, "expert", e, i))


def test_dispatcher_alone_is_not_enough_in_fp32(ranks):
    """Negative control: with Megatron's own GEMMs (CPU fp32 mm is not row-stable below 8 rows), a
    token alone does not reproduce its in-batch output; the row-stable swap is what fixes it."""
    diffs = 0
    for kind in KINDS:
        for rank in ranks:
            rec = rank["row_stable"][("fp32", kind)]
            ref = rec["stock"]["out"][:2]  # dispatcher-only == stock bitwise (test_equals_megatron_dispatcher)
            diffs += not torch.equal(rec["dispatcher_only_alone"]["out"], ref)
    assert diffs > 0

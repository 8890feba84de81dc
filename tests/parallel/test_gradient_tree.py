"""GradientTree (moe_dispatch.parallel): a training run bitwise the same on six layouts with L = 4.

The issue's model (a dense layer, two MoE layers with a shared expert, aux loss and z-loss, a dense
head), AdamW with weight decay, clipping at 1.0, 3 steps, on (world, EP, A) = (4, 4, 1), (4, 2, 1),
(4, 1, 1), (2, 2, 2), (2, 1, 2), (1, 1, 4): every parameter (the routed experts by global expert
id), each step's global loss and the clipped norm are bitwise equal across the layouts. Today's
reducers (gradient accumulation into .grad, allreduce_expert_grads, an all-reduce) on the same
layouts agree only within rounding: the gap the tree closes.
"""
from __future__ import annotations

import pytest
import torch

from moe_dispatch import MoEConfig, MoELayer
from moe_dispatch.parallel import GradientTree
from tests.dispatcher.harness import run_ranks, value_error_of

from .gradient_tree_refusal_workers import refusal_worker
from .gradient_tree_workers import LAYOUTS, VARIANTS, assemble, halving_worker, held_bytes_worker, layouts_worker


@pytest.fixture(scope="module")
def cpu_results():
    return run_ranks(layouts_worker, 4, "cpu", torch.float32, True, False, ("tree", "sync-free tree"), timeout=300)


def _check_bitwise(merged: dict) -> None:
    assert set(merged) == set(LAYOUTS)
    ref = merged[LAYOUTS[0]]
    assert any(k.startswith("norm") for k in ref) and any("experts.weight1[3]" in k for k in ref)
    for layout in LAYOUTS[1:]:
        got = merged[layout]
        assert set(got) == set(ref), layout
        differ = [k for k in ref if not torch.equal(got[k], ref[k])]
        assert not differ, (layout, differ[:8])


def test_layouts_bitwise_with_gradient_tree(cpu_results):
    merged = assemble(cpu_results, "tree")
    _check_bitwise(merged)
    ref = merged[LAYOUTS[0]]
    assert 0 < float(ref["norm 0"]) and all(torch.isfinite(ref[f"loss {i}"]) for i in range(3))
    # clipping at 1.0 was active (the norms are ~1.6..2 here), so the clipped update is what matched
    assert all(float(ref[f"norm {i}"]) > 1.0 for i in range(3))
    moved = assemble(cpu_results, "initial")[LAYOUTS[0]]
    assert all(not torch.equal(moved[k], ref[k]) for k in moved), "a parameter did not train"


def _check_variants(results: list, base: str = "tree", *others: str) -> None:
    """Each of ``others`` (e.g. the sync-free step at EP > 1: ep_capacity_factor, its blocks of each
    (expert, source) on the device, its padding and trailing rows in none): bitwise across the six
    layouts, and bitwise the ``base`` runs (it moves the same rows in the same order while nothing
    is capped)."""
    reference = assemble(results, base)
    for name in others:
        merged = assemble(results, name)
        _check_bitwise(merged)
        for layout in LAYOUTS:
            differ = [k for k in reference[layout] if not torch.equal(merged[layout][k], reference[layout][k])]
            assert not differ, (name, layout, differ[:8])


def test_layouts_bitwise_with_gradient_tree_sync_free(cpu_results):
    """Issue 50, item 4: GradientTree refused the sync-free step at EP > 1 (no per-source blocks)."""
    _check_variants(cpu_results, "tree", "sync-free tree")


def test_partials_do_not_grow_with_ep_size():
    """Issue 50, item 1: at EP 2 the tree held one fp32 stack per (expert, source), 2x the local
    expert weights; now the sources are paired in each micro-step: after micro-batches 1..4 at
    A = 4 it holds 1, 1, 2, 1 fp32 copies of the rank's own parameters (the binary counter). With
    the overlapped exchange a micro-step's node waits in it until the next call (the step's last
    is exchanged at once): 1, 2, 2, 1, the same most (log2(A) = 2). The gradients are bitwise the
    same either way."""
    for held in run_ranks(held_bytes_worker, 2, timeout=120):
        assert held[False] == [1.0, 1.0, 2.0, 1.0], held
        assert held[True] == [1.0, 2.0, 2.0, 1.0], held
        assert held["same grads"]


def test_held_bytes_by_part_and_exchange_totals():
    """What bench_gradient_tree.py --breakdown reads. At (2, 2, 4), fp32: after each backward the
    experts' per-source gradients wait already paired over the P = 2 sources: one fp32 copy of the
    local expert weights, not the backward's [E_local, P, ...] (twice them); after add_micro_batch
    none. Inside the backward the largest [E_local, P, ...] handed over is P = 2 times the largest
    local expert weight (source_grads_transient_bytes). "partials" + "in flight" is held_bytes.
    The exchange (W = 2, one doubling step, which the experts sharded over both ranks do not join)
    sends the replicated parameters in fp32 once per micro-batch: 4 x 4 bytes a value."""
    for held in run_ranks(held_bytes_worker, 2, timeout=120):
        unit, experts = held["unit"], held["expert bytes"]
        after_backward, after_add = held["parts"][0::2], held["parts"][1::2]
        assert [p["source blocks"] for p in after_backward] == [experts] * 4, held["parts"]
        assert [p["source blocks"] for p in after_add] == [0] * 4, held["parts"]
        assert held["transient"] == 2 * held["largest expert weight"], held["transient"]
        assert [(p["partials"] + p["in flight"]) / unit for p in after_add] == held[True], held["parts"]
        assert [p["in flight"] / unit for p in after_add] == [1.0, 1.0, 1.0, 0.0], held["parts"]
        seconds, sent = held["exchange"]
        assert sent == 4 * (unit - experts), (sent, unit, experts)
        assert seconds > 0


def test_layouts_bitwise_with_the_halving_exchange():
    """The exchange's halving form (a reduce-scatter by recursive halving and an all-gather, which
    the tree takes from 8 MiB a micro-step) forced on this small model: every layout's parameters,
    losses and norms bitwise those of recursive doubling, so bitwise across the layouts too."""
    results = run_ranks(halving_worker, 4, timeout=300)
    assert sum(r["default calls"] for r in results) == 0
    assert all(r["halving calls"] > 0 for r in results[:2])  # ranks 0-1 run every layout with W > 1
    default, halved = assemble(results, "default"), assemble(results, "halving")
    _check_bitwise(halved)
    for layout in LAYOUTS:
        differ = [k for k in default[layout] if not torch.equal(default[layout][k], halved[layout][k])]
        assert not differ, (layout, differ[:8])


def test_todays_reducers_differ_across_layouts(cpu_results):
    merged = assemble(cpu_results, "today")
    ref = merged[LAYOUTS[0]]
    differ = {layout for layout in LAYOUTS[1:] for k in ref if not torch.equal(merged[layout][k], ref[k])}
    assert differ, "today's reducers were bitwise across layouts"
    for layout in LAYOUTS[1:]:  # within rounding: the same gradients, other summation orders
        for k in ref:
            assert torch.allclose(merged[layout][k], ref[k], rtol=1e-3, atol=1e-5), (layout, k)


def test_refusals_name_the_argument(cpu_results):
    for rank, out in enumerate(cpu_results):
        errors = out["refusals"]
        assert "contiguous blocks" in errors["strided EP groups"], (rank, errors)
        assert "global_aux_loss" in errors["global_aux_loss"] and "aux_loss" in errors["global_aux_loss"], rank
        assert errors["micro_batches"].startswith("micro_batches must be a power of two"), rank
        assert "micro_batches differs across group: [2, 1, 1, 1]" in errors["micro_batches differ"], (rank, errors)
        if rank < 3:
            assert errors["group of 3"].startswith("group: its size must be a power of two"), rank


def test_single_process_misuse():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), MoELayer(MoEConfig(hidden_size=4, num_experts=2, topk=2,
                                                                           ffn_hidden_size=8), layer_index=0))
    assert value_error_of(lambda: GradientTree(model, 0)).startswith("micro_batches must be a power of two")
    assert value_error_of(lambda: GradientTree(model, True)).startswith("micro_batches must be a power of two")
    assert value_error_of(lambda: GradientTree(model, 2, overlap=1)) == "overlap must be True or False, got 1"
    tree = GradientTree(model, micro_batches=2)
    assert value_error_of(tree.reduce).startswith("reduce: 0 micro-batches")
    assert value_error_of(lambda: tree.clip_grad_norm_(1.0)).startswith("clip_grad_norm_: call reduce()")
    for _ in range(2):
        model(torch.randn(3, 4)).square().mean().backward()
        tree.add_micro_batch()
    assert "already 2 micro-batches" in value_error_of(tree.add_micro_batch)
    # a refused add_micro_batch drops the step on every rank (another rank may be in another call)
    assert value_error_of(tree.reduce).startswith("reduce: 0 micro-batches")
    for _ in range(2):
        model(torch.randn(3, 4)).square().mean().backward()
        tree.add_micro_batch()
    tree.reduce()
    norm = tree.clip_grad_norm_(1e9)
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()
    assert torch.allclose(norm, expected, rtol=1e-6), (norm, expected)
    assert "max_norm" in value_error_of(lambda: tree.clip_grad_norm_(float("nan")))
    model(torch.randn(3, 4)).square().mean().backward()  # no zero_grad after the step
    assert "zero_grad" in value_error_of(tree.add_micro_batch)


def test_layouts_bitwise_fp8():
    """The same six layouts with the MoE layers in FP8, CPU, one spawn: fp8_wgrad=False (the expert
    weight gradients per (expert, source) block from the widened FP8 rows) and, issue 50 item 3,
    fp8_wgrad=True (FP8 wgrad with column scales per (expert, source) block), each dropless and
    with the sync-free step at EP > 1 (bitwise the dropless run): bitwise across the layouts."""
    results = run_ranks(layouts_worker, 4, "cpu", torch.float32, False, True, tuple(VARIANTS), timeout=300)
    merged = assemble(results, "tree")
    _check_bitwise(merged)
    _check_variants(results, "tree", "sync-free tree")
    _check_bitwise(assemble(results, "fp8 wgrad tree"))
    _check_variants(results, "fp8 wgrad tree", "fp8 wgrad sync-free tree")
    moved = assemble(results, "initial")[LAYOUTS[0]]
    assert all(not torch.equal(moved[k], merged[LAYOUTS[0]][k]) for k in moved), "a parameter did not train"
    wgrad = assemble(results, "fp8 wgrad tree")[LAYOUTS[0]]  # another weight gradient: other weights
    assert any(not torch.equal(wgrad[k], merged[LAYOUTS[0]][k]) for k in wgrad if "experts.weight" in k)


@pytest.mark.gpu
def test_layouts_bitwise_on_one_gpu_bf16():
    """The same six layouts on one GPU (4 gloo ranks sharing it), bf16: torch._grouped_mm with a
    group per (expert, source) for the experts' weight gradient; dropless and sync-free (device
    blocks: no host read)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    results = run_ranks(layouts_worker, 4, "cuda", torch.bfloat16, False, False, ("tree", "sync-free tree"),
                        timeout=600)
    _check_bitwise(assemble(results, "tree"))
    _check_variants(results, "tree", "sync-free tree")


@pytest.mark.gpu
def test_layouts_bitwise_on_one_gpu_fp8():
    """The same on one GPU in FP8: fp8_wgrad=False (bf16 grouped GEMMs per (expert, source)) and
    fp8_wgrad=True (the FP8 wgrad kernel with a group per (expert, source)), dropless and sync-free."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    results = run_ranks(layouts_worker, 4, "cuda", torch.bfloat16, False, True, tuple(VARIANTS), timeout=600)
    _check_bitwise(assemble(results, "tree"))
    _check_variants(results, "tree", "sync-free tree")
    _check_bitwise(assemble(results, "fp8 wgrad tree"))
    _check_variants(results, "fp8 wgrad tree", "fp8 wgrad sync-free tree")


# ---- misuse on 2 ranks: the same ValueError on every rank, never a silent wrong, a hang or an abort ----
@pytest.fixture(scope="module")
def refusals():
    return run_ranks(refusal_worker, 2, timeout=120)


def _alike(outcomes: list, *words: str) -> str:
    """The ValueError both ranks raised (the same text), which names every one of ``words``."""
    assert outcomes[0] == outcomes[1], outcomes
    message = outcomes[0]
    assert message is not None and message.startswith("ValueError: "), outcomes
    assert all(w in message for w in words), (words, message)
    return message


def test_parameter_frozen_after_build_is_refused_then_stays_still(refusals):
    """Issue 46, item 3: AdamW moved a parameter frozen after the tree was built (its .grad a zero)."""
    both = [r["frozen"] for r in refusals]
    _alike([b["refused"] for b in both], "head.bias", "requires_grad=False", "GradientTree(model")
    for b in both:  # a tree built again: no .grad, not moved; the rest trained
        assert b["rebuilt"] is None and b["still"] and b["grad"] is None and b["moved"], b
    # frozen on rank 1 only: refused on both ranks too, naming the rank
    _alike([r["frozen on one rank"]["refused"] for r in refusals], "group rank 1", "head.bias")


def test_parameter_unfrozen_after_build_is_refused_then_reduced(refusals):
    """Issue 46, item 4: a parameter unfrozen after the tree was built was never reduced."""
    both = [r["unfrozen"] for r in refusals]
    _alike([b["refused"] for b in both], "head.bias", "requires_grad=True", "GradientTree(model")
    assert both[0]["rebuilt"] is None and both[1]["rebuilt"] is None, both
    for name, value in both[0]["params"].items():  # the replicas stay bitwise equal
        assert torch.equal(value, both[1]["params"][name]), name


def test_parameter_order_must_agree(refusals):
    """Issue 46, item 5: same-shaped layers registered in another order on one rank were summed
    crosswise (rank 0's first with rank 1's second)."""
    _alike([r["order"] for r in refusals], "group rank 1", "second.weight", "first.weight", "#0")


@pytest.mark.parametrize("case", ["micro_batches", "global_aux_loss"])
def test_refusal_on_one_rank_raises_on_every_rank(refusals, case):
    """Issue 46, item 8: a refusal true on rank 1 only raised there; rank 0 waited in the agreement."""
    _alike([r[case] for r in refusals], "group rank 1", case)


def test_float64_on_one_rank_refused_before_any_reduction(refusals):
    """Issue 46, item 10: the head in float64 on rank 1 only aborted the process in gloo at reduce."""
    _alike([r["float64"] for r in refusals], "group rank 1", "head.weight", "float64", "float32")


def test_micro_batch_count_on_one_rank_raises_on_every_rank(refusals):
    _alike([r["micro-batch count"] for r in refusals], "group rank 1", "1 micro-batches", "micro_batches=2")


def test_clip_after_zero_grad_names_the_order():
    """Issue 46, item 14: clip_grad_norm_ after optimizer.zero_grad() was an AttributeError."""
    model = torch.nn.Linear(4, 2)
    tree = GradientTree(model, micro_batches=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    tree.add_micro_batch()
    tree.reduce()
    opt.step()
    opt.zero_grad()
    message = value_error_of(lambda: tree.clip_grad_norm_(1.0))
    assert message is not None and "weight" in message and "zero_grad" in message, message
    assert "reduce(), clip_grad_norm_(), optimizer.step(), optimizer.zero_grad()" in message, message

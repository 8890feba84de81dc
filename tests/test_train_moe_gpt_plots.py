"""scripts/train_moe_gpt.py's plots and table labels on synthetic data (the runs themselves:
tests/integrations/test_train_moe_gpt.py): the difference plot draws ours at 0 on a visible
baseline under the log axis and stock Megatron above it; the loss plot draws every run in one
panel, its legend saying per (EP size, variant) whether the two dispatchers are bitwise equal;
every label inside the drawing."""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.svg_bounds import labels_outside, labels_overlapping

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import svg_plot  # noqa: E402
import train_moe_gpt  # noqa: E402

NS = "{http://www.w3.org/2000/svg}"


def _dump(steps: int = 10) -> dict:
    """main's dump: per run, each rank's losses; ours equal between dispatchers, stock not."""
    dump = {}
    for ep in (1, 2):
        for variant in ("ours", "stock"):
            for n, kind in enumerate(("allgather", "alltoall")):
                bump = 0.0 if variant == "ours" else n * 10.0 ** -(2 + ep) * (1 + (ep % 2))
                losses = [[5.0 - 0.1 * i + bump * (i > 0) + r * 1e-3 for i in range(steps)] for r in range(2)]
                dump[f"EP {ep} {variant}-{kind}"] = dict(rank_losses=losses, mean_losses=losses[0])
    return dump


def test_dispatcher_differences():
    diffs = train_moe_gpt.dispatcher_differences(_dump())
    assert sorted(diffs) == ["EP 1 moe-dispatch", "EP 1 stock Megatron", "EP 2 moe-dispatch", "EP 2 stock Megatron"]
    assert all(v == 0 for v in diffs["EP 1 moe-dispatch"] + diffs["EP 2 moe-dispatch"])
    assert diffs["EP 1 stock Megatron"][0] == 0 and all(v > 0 for v in diffs["EP 1 stock Megatron"][1:])


def test_diff_svg_draws_ours_at_zero_and_stock_above(tmp_path):
    path = tmp_path / "diff.svg"
    diffs = train_moe_gpt.dispatcher_differences(_dump())
    train_moe_gpt.write_diff_svg(str(path), diffs, "title")
    root = ET.parse(path).getroot()
    lines = root.findall(f"{NS}polyline")
    assert len(lines) == len(diffs)
    ys = {label: [float(p.split(",")[1]) for p in line.get("points").split()] for label, line in zip(diffs, lines)}
    height = float(root.get("height"))
    zero = ys["EP 1 moe-dispatch"][0]
    assert 0 < zero < height and set(ys["EP 1 moe-dispatch"]) == {zero} == set(ys["EP 2 moe-dispatch"])
    assert all(y < zero - 10 for y in ys["EP 1 stock Megatron"][1:])  # above the baseline, past the break
    assert len(root.findall(f"{NS}circle")) == sum(len(v) for v in diffs.values())  # a marker per step
    texts = [t.text for t in root.findall(f"{NS}text")]
    assert "0 (bitwise)" in texts and any(t.startswith("1e") for t in texts)
    assert "EP 1 moe-dispatch (0 at every step)" in texts


def test_loss_svg_one_panel_every_curve(tmp_path):
    """One panel (it was four, one per EP size and variant, that showed nothing one panel does not):
    a curve per run, a colour and a dash per (EP size, variant), a legend entry per pair saying
    whether its dispatchers are bitwise equal."""
    path = tmp_path / "loss.svg"
    series = {name: run["mean_losses"] for name, run in _dump().items()}
    train_moe_gpt.write_svg(str(path), series, "title")
    root = ET.parse(path).getroot()
    assert len(root.findall(f"{NS}rect")) == 2  # the background and the one plot frame
    lines = root.findall(f"{NS}polyline")
    assert len(lines) == len(series)
    styles = {(line.get("stroke"), line.get("stroke-dasharray")) for line in lines}
    assert len(styles) == 4  # per (EP size, variant); its two dispatchers share it, told apart by width
    assert len({(line.get("stroke"), line.get("stroke-width")) for line in lines}) == 8
    entries = [t.text for t in root.findall(f"{NS}text") if t.text and t.text.startswith("EP ")]
    assert entries == ["EP 1 moe-dispatch: dispatchers bitwise equal; step 9: 4.100",
                       "EP 1 stock Megatron: dispatchers differ; step 9: 4.100 / 4.102",
                       "EP 2 moe-dispatch: dispatchers bitwise equal; step 9: 4.100",
                       "EP 2 stock Megatron: dispatchers differ; step 9: 4.100 / 4.100"]
    assert labels_outside(path) == [] and labels_overlapping(path) == []


@pytest.mark.parametrize("writer", ["write_svg", "write_diff_svg"])
def test_every_label_inside_the_drawing(tmp_path, writer):
    """Legends as wide as their longest entry, titles wrapped to the drawing: the GPU run's title and
    legend ran past the right edge of the difference plot at a fixed 760-px width."""
    dump = _dump(steps=50)
    series = ({name: run["mean_losses"] for name, run in dump.items()} if writer == "write_svg"
              else train_moe_gpt.dispatcher_differences(dump))
    title = ("allgather vs alltoall: loss difference per step; GPTModel 2x MoE (E 16, K 4), bf16, 8 ranks, nccl, "
             "CUDA, a long device name, another part")
    path = tmp_path / "plot.svg"
    getattr(train_moe_gpt, writer)(str(path), series, title)
    assert labels_outside(path) == [] and labels_overlapping(path) == []
    lines = [t.text for t in ET.parse(path).getroot().findall(f"{NS}text") if t.get("font-size") == "14"]
    assert len(lines) >= 2 and " ".join(lines) == title


@pytest.mark.parametrize("name", ["BENCHMARKS_train_loss.svg", "BENCHMARKS_dispatcher_diff.svg",
                                  "BENCHMARKS_fp8_loss.svg", "BENCHMARKS_fp8_wide_wgrad_loss.svg"])
def test_committed_plot_is_drawn_from_its_embedded_data(tmp_path, name):
    """The committed plot is what its writer draws now from the data in the file (redraw after a
    layout change: python scripts/svg_plot.py FILE)."""
    committed = ROOT / name
    copy = tmp_path / name
    copy.write_text(committed.read_text())
    svg_plot.replot(copy)
    assert copy.read_text() == committed.read_text()
    assert labels_outside(committed) == [] and labels_overlapping(committed) == []


def test_table_labels_say_which_rows_are_references():
    assert train_moe_gpt.row_status("EP 1 stock Megatron: loss bitwise", False, False) == "DIFF (reference)"
    assert train_moe_gpt.row_status("EP 1 vs EP 2 moe-dispatch (allgather): loss", False, False) == "DIFF (not claimed)"
    assert train_moe_gpt.row_status("EP 1 moe-dispatch: loss", False, True) == "FAIL"
    assert train_moe_gpt.row_status("anything", True, False) == "PASS"
    assert "expected to differ" in train_moe_gpt.TABLE_LEGEND

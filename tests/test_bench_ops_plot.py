"""scripts/bench_ops.py's plot writer: one line and one legend entry per series, every point inside
the plot area (the benchmark itself needs CUDA; its timings are never asserted)."""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.svg_bounds import labels_outside, labels_overlapping

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import bench_ops  # noqa: E402
import svg_plot  # noqa: E402


def test_write_svg_draws_every_series(tmp_path):
    series = {"copy (reference)": [(2 ** 20, 1.0), (2 ** 26, 3.9), (2 ** 31, 4.2)],
              "permute incl. map": [(2 ** 21, 0.5), (2 ** 27, 3.1), (2 ** 32, 3.6)],
              "unpermute bwd": [(2 ** 22, 6.5), (2 ** 30, 3.9)]}
    path = tmp_path / "bw.svg"
    bench_ops.write_svg(str(path), series, "title")
    root = ET.parse(path).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    width, height = float(root.get("width")), float(root.get("height"))
    lines = root.findall(f"{ns}polyline")
    assert len(lines) == len(series)
    for line, points in zip(lines, series.values()):
        xy = [tuple(map(float, p.split(","))) for p in line.get("points").split()]
        assert len(xy) == len(points)
        assert all(0 <= x <= width and 0 <= y <= height for x, y in xy)
        assert [x for x, _ in xy] == sorted(x for x, _ in xy)  # log x keeps the order
    labels = [t.text for t in root.findall(f"{ns}text")]
    assert all(name in labels for name in series)
    assert "6" in labels  # the y axis stretches past 5 TB/s when a point does


def test_x_labels_do_not_crowd(tmp_path):
    """A sweep over 2^17..2^33 bytes labels at most 7 ticks, slanted (they overlapped when every
    power of two had an upright label)."""
    series = {"copy (reference)": [(2 ** e, 3.0) for e in range(17, 34)]}
    path = tmp_path / "bw.svg"
    bench_ops.write_svg(str(path), series, "title")
    ns = "{http://www.w3.org/2000/svg}"
    ticks = [t for t in ET.parse(path).getroot().findall(f"{ns}text") if t.text.endswith(("KiB", "MiB", "GiB"))]
    assert 3 <= len(ticks) <= 7 and all("rotate" in t.get("transform", "") for t in ticks)
    assert len({t.text for t in ticks}) == len(ticks)


def test_every_label_inside_the_drawing(tmp_path):
    """The legend is as wide as its longest label and the drawing as wide as its title: the sweep's
    "unpermute bwd, per-token route" ran past the right edge at a fixed 190-px legend."""
    series = {"copy (reference)": [(2 ** 20, 1.0), (2 ** 31, 4.2)],
              "unpermute bwd, probs grad, per-token route, a long label": [(2 ** 21, 0.5), (2 ** 32, 3.6)]}
    path = tmp_path / "bw.svg"
    bench_ops.write_svg(str(path), series, "permute / unpermute on a device with a long name, bf16, " * 2)
    assert labels_outside(path) == [] and labels_overlapping(path) == []


def test_committed_plot_is_drawn_from_its_embedded_data(tmp_path):
    """BENCHMARKS_bandwidth.svg (a GPU sweep) is what write_svg draws now from the data in the file,
    so a layout change that is not redrawn fails here (redraw: python scripts/svg_plot.py FILE)."""
    committed = ROOT / "BENCHMARKS_bandwidth.svg"
    copy = tmp_path / committed.name
    copy.write_text(committed.read_text())
    svg_plot.replot(copy)
    assert copy.read_text() == committed.read_text()
    assert labels_outside(committed) == []
    meta = svg_plot.read_metadata(committed)
    assert meta["writer"] == "bench_ops:write_svg" and len(meta["kwargs"]["series"]) == 6

"""BENCHMARKS_speed.svg: the speed picture, drawn from recorded figures only.

Two panels of horizontal bars: the EP-1 layer's forward + backward time (ours eager and captured,
Megatron after ``install()`` and stock), and our permute / unpermute kernels beside
TransformerEngine's as multiples of the byte floor. Every figure comes from scripts/speed_figures.json,
which says where in BENCHMARKS.md each one is recorded (tests/test_plot_speed.py checks them there);
nothing is measured here, so this runs without a GPU:

    python scripts/plot_speed.py            # writes BENCHMARKS_speed.svg
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import svg_plot  # scripts/svg_plot.py: python puts this script's folder first on its path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "scripts" / "speed_figures.json"
OUT = ROOT / "BENCHMARKS_speed.svg"
BAR_W = 440  # px of the longest axis
CAPTION_SIZE = 11


def load(path: str | Path = DATA) -> dict:
    return json.loads(Path(path).read_text())


def _number(value: str) -> float:
    return float(value.rstrip("x"))


def _with_unit(value: str, unit: str) -> str:
    return value if value.endswith(unit) else value + unit


def _rows(panel: dict) -> list[tuple[str, str | None, list[tuple[str, str]]]]:
    """Per bar group: (label, None or a legend-less single colour, [(value, colour)])."""
    if "bars" in panel:
        return [(b["label"], b["color"], [(b["value"], b["color"])]) for b in panel["bars"]]
    colors = [s["color"] for s in panel["series"]]
    return [(g["label"], None, [(b["value"], c) for b, c in zip(g["bars"], colors)]) for g in panel["groups"]]


def render(figures: dict) -> str:
    """The SVG text of ``figures`` (speed_figures.json's content): widths from the text it holds."""
    labels = [label for panel in figures["panels"] for label, _, _ in _rows(panel)]
    label_w = max(svg_plot.text_width(t) for t in labels) + 16
    value_w = 70
    captions = [line for panel in figures["panels"] for line in panel["caption"]]
    legends = [sum(16 + svg_plot.text_width(s["label"]) + 20 for s in p["series"]) for p in figures["panels"]
               if "series" in p]
    width = max(10 + label_w + max([BAR_W + value_w, *legends]),
                20 + max(svg_plot.text_width(t, CAPTION_SIZE) for t in captions),
                20 + svg_plot.text_width(figures["title"], 15),
                20 + max(svg_plot.text_width(p["heading"], 13) for p in figures["panels"]))
    x0 = 10 + label_w
    body, y = [svg_plot.text(10, 24, figures["title"], font_size=15, font_weight="bold")], 36
    for panel in figures["panels"]:
        body.append(svg_plot.text(10, y + 22, panel["heading"], font_size=13, font_weight="bold"))
        y += 32
        if "series" in panel:  # the legend, one line under the heading
            lx = x0
            for s in panel["series"]:
                body.append(f'<rect x="{lx:.1f}" y="{y + 4}" width="12" height="12" fill="{s["color"]}"/>'
                            + svg_plot.text(lx + 16, y + 14, s["label"]))
                lx += 16 + svg_plot.text_width(s["label"]) + 20
            y += 22
        rows = _rows(panel)
        top_value = max(_number(v) for _, _, bars in rows for v, _ in bars)
        ticks = svg_plot.nice_ticks(0, top_value * 1.02)
        if ticks[-1] < top_value:
            ticks.append(ticks[-1] + (ticks[-1] - ticks[-2]))
        scale = BAR_W / ticks[-1]
        line_y, bar_h = y + 14, 18 if len(rows[0][2]) == 1 else 13  # the reference line's label sits above it
        y = line_y + 4
        for label, _, bars in rows:
            group_h = bar_h * len(bars) + 2 * (len(bars) - 1)
            body.append(svg_plot.text(x0 - 8, y + group_h / 2 + 4, label, text_anchor="end"))
            for value, color in bars:
                w = _number(value) * scale
                body.append(f'<rect x="{x0}" y="{y:.1f}" width="{w:.1f}" height="{bar_h}" fill="{color}"/>'
                            + svg_plot.text(x0 + w + 5, y + bar_h - 4, _with_unit(value, panel["unit"]),
                                            font_size=11))
                y += bar_h + 2
            y += 10 - 2
        axis_y = y
        body.append(f'<line x1="{x0}" y1="{axis_y}" x2="{x0 + BAR_W}" y2="{axis_y}" stroke="#444"/>')
        for t in ticks:
            x = x0 + t * scale
            body.append(f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 4}" stroke="#444"/>'
                        + svg_plot.text(x, axis_y + 16, _with_unit(f"{t:g}", panel["unit"]), text_anchor="middle",
                                        font_size=11))
        mark = panel["line"]
        mx = x0 + _number(mark["value"]) * scale
        body.append(f'<line x1="{mx:.1f}" y1="{line_y - 2}" x2="{mx:.1f}" y2="{axis_y}" stroke="#222" '
                    'stroke-dasharray="4,3"/>' + svg_plot.text(mx + 4, line_y - 3, mark["label"], font_size=11))
        y = axis_y + 22
        for line in panel["caption"]:
            y += 14
            body.append(svg_plot.text(10, y, line, font_size=CAPTION_SIZE, fill="#444"))
        y += 6
    return "\n".join([*svg_plot.header(width, y + 8), *body, "</svg>"]) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(DATA), help="the figures (default: scripts/speed_figures.json)")
    parser.add_argument("--out", default=str(OUT), help="the SVG to write (default: BENCHMARKS_speed.svg)")
    args = parser.parse_args(argv)
    Path(args.out).write_text(render(load(args.data)))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

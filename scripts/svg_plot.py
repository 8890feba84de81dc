"""What the benchmark plots share: plain SVG, written by hand so that no benchmark needs a plotting
package. Each writer sizes its text by ``text_width`` (a sans-serif glyph is about 0.6 of the font
size wide). The measurement plots (bench_ops, train_moe_gpt) embed the data they drew, so that a
plot can be drawn again from its own file when the layout changes but the measurement (often a GPU
run) cannot be repeated:

    python scripts/svg_plot.py BENCHMARKS_bandwidth.svg BENCHMARKS_dispatcher_diff.svg BENCHMARKS_train_loss.svg
"""
from __future__ import annotations

import importlib
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from xml.sax.saxutils import escape

CHAR_WIDTH = 0.6  # of the font size, for one character of a sans-serif font (an upper estimate)
NS = "{http://www.w3.org/2000/svg}"


def text_width(text: str, size: float = 12) -> float:
    """Estimated width in px of ``text`` at font size ``size``."""
    return CHAR_WIDTH * size * len(text)


def wrap(content: str, width: float, size: float = 12) -> list[str]:
    """``content`` in lines no wider than ``width`` px: broken after "; " where it must be, and a
    part still too wide after ", " (a piece wider than ``width`` stays whole)."""
    def greedy(parts: list[str]) -> list[str]:
        lines = [parts[0]]
        for part in parts[1:]:
            if text_width(f"{lines[-1]} {part}", size) <= width:
                lines[-1] = f"{lines[-1]} {part}"
            else:
                lines.append(part)
        return lines

    out = []
    for line in greedy(content.replace("; ", ";\n").split("\n")):
        out += greedy(line.replace(", ", ",\n").split("\n")) if text_width(line, size) > width else [line]
    return out


def nice_ticks(lo: float, hi: float, most: int = 7) -> list[float]:
    """Multiples of 1, 2, 2.5 or 5 x 10^k inside [lo, hi], at most ``most`` of them (at least 2
    where the range holds them)."""
    import math

    span = hi - lo if hi > lo else 1.0
    for exp in range(math.floor(math.log10(span)) - 1, math.ceil(math.log10(span)) + 1):
        for m in (1, 2, 2.5, 5):
            step = m * 10.0 ** exp
            first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
            if last - first + 1 <= most:
                return [round(k * step, 10) for k in range(first, last + 1)]
    return [lo, hi]


def header(width: float, height: float, font_size: int = 12) -> list[str]:
    """The opening tag (its viewBox is the drawing's extent) and a white background."""
    return [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="sans-serif" font-size="{font_size}">',
            f'<rect width="{width:.0f}" height="{height:.0f}" fill="white"/>']


def text(x: float, y: float, content: str, **attrs: str) -> str:
    """A <text> element; ``attrs`` with ``_`` for ``-`` (text_anchor="end")."""
    extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in attrs.items())
    return f'<text x="{x:.1f}" y="{y:.1f}"{extra}>{escape(content)}</text>'


def metadata(writer: str, **kwargs) -> str:
    """The writer (``module:function`` in scripts/) and its arguments other than the path, as JSON in a
    <metadata> element: what ``replot`` calls the writer with."""
    return f"<metadata>{escape(json.dumps(dict(writer=writer, kwargs=kwargs), separators=(',', ':')))}</metadata>"


def read_metadata(path: str | Path) -> dict:
    """``{"writer": ..., "kwargs": ...}`` from a plot written with ``metadata``."""
    node = ET.parse(path).getroot().find(f"{NS}metadata")
    if node is None or not node.text:
        raise ValueError(f"{path}: no <metadata> with the plot's data (written before the plots embedded it)")
    return json.loads(node.text)


def replot(path: str | Path) -> None:
    """Draw ``path`` again, in place, from the data embedded in it, with the writer's current code.
    The writer's module is a script beside this one: importable wherever this module was imported
    as ``svg_plot`` (its folder on the path: ``python scripts/svg_plot.py``, or the tests)."""
    meta = read_metadata(path)
    module, _, function = meta["writer"].partition(":")
    getattr(importlib.import_module(module), function)(str(path), **meta["kwargs"])


def write(path: str | Path, lines: list[str]) -> None:
    Path(path).write_text("\n".join([*lines, "</svg>"]) + "\n")


if __name__ == "__main__":
    for name in sys.argv[1:]:
        replot(name)
        print(f"redrew {name}")

"""Test helper: which texts of a hand-written SVG fall outside its viewBox, and which overlap.

A text's box is estimated, not measured: 0.6 x its font size per character wide (sans-serif glyphs
average less), from 0.8 x the size above its baseline to 0.25 x below, placed by its text-anchor
and turned by its ``rotate(a cx cy)`` transform. A label clipped at the edge of the drawing, or
two labels drawn over each other, shows as a box outside the viewBox or two boxes that intersect."""
from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

NS = "{http://www.w3.org/2000/svg}"


def _boxes(path: str | Path) -> tuple[tuple[float, ...], list[tuple[str, list[tuple[float, float]], bool]]]:
    root = ET.parse(path).getroot()
    if root.get("viewBox") is None:
        raise ValueError(f"{path}: the <svg> element has no viewBox (the extent every label must lie inside)")
    view = tuple(float(v) for v in root.get("viewBox").split())
    base_size = float(root.get("font-size", 16))
    out = []
    for node in root.iter(f"{NS}text"):
        label = "".join(node.itertext())
        size = float(node.get("font-size", base_size))
        x, y = float(node.get("x", 0)), float(node.get("y", 0))
        w = 0.6 * size * len(label)
        x0 = {"start": x, "middle": x - w / 2, "end": x - w}[node.get("text-anchor", "start")]
        corners = [(x0, y - 0.8 * size), (x0 + w, y - 0.8 * size), (x0 + w, y + 0.25 * size), (x0, y + 0.25 * size)]
        rotated = re.fullmatch(r"rotate\(\s*(-?[\d.]+)[ ,]+(-?[\d.]+)[ ,]+(-?[\d.]+)\s*\)", node.get("transform", ""))
        if node.get("transform") and not rotated:
            raise ValueError(f"{path}: text {label!r} has a transform this check cannot place: {node.get('transform')}")
        if rotated:
            a, cx, cy = (float(v) for v in rotated.groups())
            c, s = math.cos(math.radians(a)), math.sin(math.radians(a))
            corners = [(cx + (px - cx) * c - (py - cy) * s, cy + (px - cx) * s + (py - cy) * c) for px, py in corners]
        out.append((label, corners, bool(rotated)))
    return view, out


def labels_outside(path: str | Path) -> list[str]:
    """The texts of ``path`` whose estimated box leaves the viewBox."""
    (vx, vy, vw, vh), boxes = _boxes(path)
    return [label for label, corners, _ in boxes
            if any(not (vx <= px <= vx + vw and vy <= py <= vy + vh) for px, py in corners)]


def labels_overlapping(path: str | Path) -> list[tuple[str, str]]:
    """Pairs of upright texts of ``path`` whose estimated boxes intersect (slanted ones are skipped:
    their axis-aligned boxes overlap their neighbours' without the glyphs touching)."""
    _, boxes = _boxes(path)
    upright = [(label, min(p[0] for p in c), max(p[0] for p in c), min(p[1] for p in c), max(p[1] for p in c))
               for label, c, rotated in boxes if not rotated]
    return [(a[0], b[0]) for i, a in enumerate(upright) for b in upright[i + 1:]
            if a[1] < b[2] and b[1] < a[2] and a[3] < b[4] and b[3] < a[4]]

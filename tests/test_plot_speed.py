"""scripts/plot_speed.py and its data, scripts/speed_figures.json: every figure it draws is recorded
in BENCHMARKS.md where the data file says (a table cell by section, row, column and part, or a
quote of the section's text), every number in its text is in the sections it cites, every label
lies inside the drawing, and the committed BENCHMARKS_speed.svg is what the script draws now."""
from __future__ import annotations

import copy
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.svg_bounds import labels_outside, labels_overlapping

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import plot_speed  # noqa: E402

FIGURES = plot_speed.load()
NS = "{http://www.w3.org/2000/svg}"


def _sections() -> dict[str, list[str]]:
    """{heading of a ## or ### section: its lines}, from BENCHMARKS.md."""
    out, name = {}, None
    for line in (ROOT / "BENCHMARKS.md").read_text().splitlines():
        if line.startswith("#"):
            name = line.lstrip("#").strip()
            out[name] = []
        elif name is not None:
            out[name].append(line)
    return out


SECTIONS = _sections()


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _cell(section: str, row: str, column: int, header: str) -> str:
    """The cell of the table in ``section`` at the row whose first cell is ``row``, checking that
    its column is headed ``header``."""
    lines = SECTIONS[section]
    for n, line in enumerate(lines):
        if line.startswith("|") and _cells(line)[0] == row:
            head = next(lines[k] for k in range(n, -1, -1) if lines[k].startswith("|") and
                        (k == 0 or not lines[k - 1].startswith("|")))
            assert _cells(head)[column] == header, (section, row, column, _cells(head))
            return _cells(line)[column]
    raise AssertionError(f"no row {row!r} in {section!r}")


def _text(section: str) -> str:
    return " ".join(" ".join(SECTIONS[section]).split())


def _table_figures(figures: dict) -> list[dict]:
    return [b for p in figures["panels"] for b in (p.get("bars") or [x for g in p["groups"] for x in g["bars"]])]


def _quotes(figures: dict) -> list[dict]:
    return [q for p in figures["panels"] for q in [p["line"], *p["quotes"]]]


@pytest.mark.parametrize("fig", _table_figures(FIGURES), ids=lambda f: f"{f['row']}:{f['header']}")
def test_every_bar_is_a_recorded_figure(fig):
    panel = next(p for p in FIGURES["panels"] if fig in _table_figures(dict(panels=[p])))
    cell = _cell(panel["section"], fig["row"], fig["column"], fig["header"])
    part = cell.replace("**", "").split(" / ")[fig.get("part", 0)]
    assert part.removesuffix(" ms") == fig["value"], (cell, fig)
    assert fig["commit"] in _text(panel["section"])
    if "run" in fig:
        assert fig["run"] == fig["header"]


@pytest.mark.parametrize("quote", _quotes(FIGURES), ids=lambda q: q["value"])
def test_every_quoted_figure_is_in_its_section(quote):
    assert quote["quote"] in _text(quote["section"]) and quote["value"] in quote["quote"]


def test_every_number_in_the_text_is_in_the_sections_cited():
    """Captions and headings carry figures too (a swing, a commit, the shape): each number in them
    appears in a section the panel cites, so none is typed in from elsewhere."""
    for panel in FIGURES["panels"]:
        sections = {panel["section"], *(q["section"] for q in [panel["line"], *panel["quotes"]])}
        cited = " ".join(_text(s) for s in sections)
        for line in [panel["heading"], *panel["caption"], panel["line"]["label"]]:
            for number in re.findall(r"\d+(?:[.,-]\d+)*x?", line):
                assert number in cited, (number, line)


def test_a_figure_not_recorded_fails():
    """The check above can fail: a bar whose value is not the recorded one, or a column under
    another heading."""
    fig = dict(_table_figures(FIGURES)[0], value="6.78")
    cell = _cell(FIGURES["panels"][0]["section"], fig["row"], fig["column"], fig["header"])
    assert cell.split(" / ")[0] != fig["value"]
    with pytest.raises(AssertionError):
        _cell(FIGURES["panels"][0]["section"], fig["row"], fig["column"], "run 4")


def test_every_label_inside_the_drawing(tmp_path):
    path = tmp_path / "speed.svg"
    path.write_text(plot_speed.render(FIGURES))
    assert labels_outside(path) == [] and labels_overlapping(path) == []
    texts = [t.text for t in ET.parse(path).getroot().iter(f"{NS}text")]
    assert all(f"{b['value']} ms" in texts for b in FIGURES["panels"][0]["bars"])
    assert all(b["value"] in texts for g in FIGURES["panels"][1]["groups"] for b in g["bars"])
    # Longer labels widen the drawing instead of running off it.
    longer = copy.deepcopy(FIGURES)
    longer["panels"][0]["bars"][0]["label"] *= 3
    longer["panels"][1]["caption"][0] *= 2
    path.write_text(plot_speed.render(longer))
    assert labels_outside(path) == [] and labels_overlapping(path) == []


def test_committed_svg_is_what_the_script_draws():
    """Redraw after changing the figures or the layout: python scripts/plot_speed.py"""
    assert (ROOT / "BENCHMARKS_speed.svg").read_text() == plot_speed.render(FIGURES)

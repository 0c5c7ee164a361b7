"""The report as one self-contained HTML file: figures embedded as base64 PNG, tables sortable
by a few lines of inline JavaScript, no network access needed to open it."""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field

import pandas as pd

from fsdp_bench.report.canvas import Figure


@dataclass
class Section:
    """A heading, a paragraph of text, then tables (caption, table) and figures."""

    title: str
    text: str = ""
    tables: list[tuple[str, pd.DataFrame]] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    in_summary: bool = False
    """Repeated in summary.md, which holds only what is worth pasting into a design doc."""


@dataclass
class Document:
    title: str
    subtitle: str
    headline: str
    """One line per world size."""
    sections: list[Section]
    provenance: dict[str, str]
    grid_text: str = ""


_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1200px;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; margin-bottom: 0.1em; }
h2 { margin-top: 1.8em; border-bottom: 1px solid #ddd; }
.subtitle { color: #555; margin-top: 0; }
.headline { background: #eef6ee; border-left: 4px solid #3a7d44; padding: 0.4em 1em;
             margin: 0.3em 0; }
table { border-collapse: collapse; margin: 0.6em 0 1.2em; font-size: 12.5px; }
th, td { border: 1px solid #ccc; padding: 3px 7px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; cursor: pointer; user-select: none; white-space: nowrap; }
th.sorted-asc::after { content: " \\25B2"; } th.sorted-desc::after { content: " \\25BC"; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr:nth-child(even) td { background: #fafafa; }
figure { margin: 1em 0 2em; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #444; font-size: 13px; max-width: 900px; }
.skipped { color: #8a5a00; } .scroll { overflow-x: auto; }
pre { background: #f6f6f6; padding: 1em; }
"""

# Click a header to sort by that column; numbers (commas, %, × stripped) sort numerically.
_SCRIPT = """
function cellValue(row, i) {
  var text = row.cells[i].textContent.trim();
  var number = parseFloat(text.replace(/[,%×]/g, ""));
  return isNaN(number) || !/^-?[\\d.,]+[%×]?$/.test(text) ? text : number;
}
function sortTable(th) {
  var table = th.closest("table"), body = table.tBodies[0];
  var i = Array.prototype.indexOf.call(th.parentNode.cells, th);
  var ascending = !th.classList.contains("sorted-asc");
  Array.prototype.forEach.call(th.parentNode.cells, function (h) {
    h.classList.remove("sorted-asc", "sorted-desc");
  });
  th.classList.add(ascending ? "sorted-asc" : "sorted-desc");
  var rows = Array.prototype.slice.call(body.rows);
  rows.sort(function (a, b) {
    var x = cellValue(a, i), y = cellValue(b, i);
    if (typeof x !== typeof y) { x = String(x); y = String(y); }
    return (x < y ? -1 : x > y ? 1 : 0) * (ascending ? 1 : -1);
  });
  rows.forEach(function (row) { body.appendChild(row); });
}
document.addEventListener("click", function (event) {
  if (event.target.tagName === "TH") { sortTable(event.target); }
});
"""


def table_html(table: pd.DataFrame) -> str:
    """A sortable table of strings; cells that read as numbers are right-aligned."""
    if table.empty:
        return "<p>(none)</p>"
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in table.columns)
    rows = []
    for values in table.itertuples(index=False):
        cells = []
        for value in values:
            text = str(value)
            numeric = text.replace(",", "").rstrip("%×").replace(".", "", 1).lstrip("-").isdigit()
            cls = ' class="num"' if numeric else ""
            cells.append(f"<td{cls}>{html.escape(text)}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return (
        f'<div class="scroll"><table><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></div>"
    )


def figure_html(figure: Figure) -> str:
    title = html.escape(figure.title)
    if figure.skipped or not figure.paths:
        return f'<p class="skipped"><b>{title}</b>: not drawn: {html.escape(figure.skipped)}</p>'
    png = next(p for p in figure.paths if p.suffix == ".png")
    data = base64.b64encode(png.read_bytes()).decode("ascii")
    return (
        f'<figure id="fig-{html.escape(figure.name)}"><img alt="{title}" '
        f'src="data:image/png;base64,{data}"><figcaption><b>{title}.</b> '
        f"{html.escape(figure.caption)}</figcaption></figure>"
    )


def render(doc: Document) -> str:
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(doc.title)}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(doc.title)}</h1>",
        f'<p class="subtitle">{html.escape(doc.subtitle)}</p>',
    ]
    parts += [f'<p class="headline">{html.escape(line)}</p>' for line in doc.headline.splitlines()]
    for section in doc.sections:
        parts.append(f"<h2>{html.escape(section.title)}</h2>")
        if section.text:
            parts.append(f"<p>{html.escape(section.text)}</p>")
        for caption, table in section.tables:
            if caption:
                parts.append(f"<h3>{html.escape(caption)}</h3>")
            parts.append(table_html(table))
        parts += [figure_html(f) for f in section.figures]
    parts.append("<h2>Provenance</h2>")
    provenance = pd.DataFrame({"": list(doc.provenance), "value": list(doc.provenance.values())})
    parts.append(table_html(provenance))
    if doc.grid_text:
        parts.append(
            "<details><summary>grid file (grid.yaml as given)</summary>"
            f"<pre>{html.escape(doc.grid_text)}</pre></details>"
        )
    parts.append(f"<script>{_SCRIPT}</script></body></html>")
    return "\n".join(parts)

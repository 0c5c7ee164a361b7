"""summary.md: the part of a report worth pasting (best configuration, the key tables, the
figures by relative path, provenance in one line), from the document the HTML renders."""

from __future__ import annotations

import pandas as pd

from fsdp_bench.report import html as html_report
from fsdp_bench.report import tables as report_tables
from fsdp_bench.report.canvas import Figure


def markdown_summary(
    doc: html_report.Document,
    best: pd.DataFrame,
    effects: pd.DataFrame,
    scaling: pd.DataFrame,
    drawn: list[Figure],
) -> str:
    """The part of the report worth pasting: best configuration, the key tables, figures by
    relative path, provenance in one line."""
    md = report_tables.markdown
    lines = [f"# {doc.title}", "", f"_{doc.subtitle}_", ""]
    lines += [f"- **{line}**" for line in doc.headline.splitlines()] + [""]
    lines += ["## Best configuration per world size", "", md(report_tables.best_table(best)), ""]
    lines += ["## Effect of each axis (median ratio over matched runs)", ""]
    lines += [md(report_tables.effects_table(effects)), ""]
    if not scaling.empty:  # at the smallest world size every efficiency is 100% by definition
        beyond = scaling[scaling["world_size"] > scaling["world_size"].min()]
        lines += ["## Scaling efficiency", "", md(report_tables.scaling_table(beyond)), ""]
    for section in [section for section in doc.sections if section.in_summary]:
        lines += [f"## {section.title}", ""] + ([section.text, ""] if section.text else [])
        for caption, table in section.tables:
            lines += ([f"### {caption}", ""] if caption else []) + [md(table), ""]
    lines += ["## Figures", ""]
    for figure in drawn:
        if figure.paths:
            lines.append(f"![{figure.title}]({figure.paths[0].name})")
        else:
            lines.append(f"- {figure.title}: not drawn ({figure.skipped})")
    p = doc.provenance
    lines += [
        "",
        f"Provenance: torch {p['torch version']}, {p['devices']}, hosts {p['hosts']}, "
        f"runs {p['first run started']} to {p['last run finished']}, grid {p['grid file']}.",
        "",
    ]
    return "\n".join(lines)

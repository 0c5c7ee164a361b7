"""What a results folder says, for people: summaries computed as plain data (tested exactly),
figures that only draw them, tables formatted once for the terminal, HTML and markdown, the
`fsdp-bench report` build, and the comparison of two folders."""

from __future__ import annotations

from fsdp_bench.report.build import ReportOutcome, build_report
from fsdp_bench.report.compare import compare_results

__all__ = ["ReportOutcome", "build_report", "compare_results"]

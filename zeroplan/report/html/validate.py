"""`zeroplan validate --format html`: the accuracy report's JSON (docs/accuracy.json) as one page: how the
errors of the peaks are distributed, every row with its errors and misses, and the published runs."""

from __future__ import annotations

from typing import Any

from zeroplan.report.common import percent
from zeroplan.report.html.page import Cell, histogram, page, paragraph, section, size, table, text

# bins of estimate / measured - 1: the targets (3% steady, 5% first step) fall on edges
_EDGES = (-1.0, -0.10, -0.05, -0.03, -0.01, 0.0, 0.01, 0.03, 0.05, 0.10, 1.0)
_LABELS = ("< -10%", "-10..-5%", "-5..-3%", "-3..-1%", "-1..0%", "0..1%", "1..3%", "3..5%", "5..10%", ">= 10%")


def validate_page(data: dict[str, Any], units: str = "MiB") -> str:
    """`data` from `report_json` (what `zeroplan validate` writes as its JSON report)."""
    tolerances = data["tolerances"]
    lead = [f"{data['command']} ({data['backend']}, {data['steps']} steps), generated {data['generated']}",
            f"targets: steady peak within {tolerances['steady']:.0%}, first step within {tolerances['first_step']:.0%}, "
            f"each category within {tolerances['category']:.0%} (or {tolerances['category_floor_bytes']:,} bytes / "
            f"{tolerances['category_floor_fraction']:.0%} of the peak); error = estimate / measured - 1"]
    compared = [row["comparison"] for row in data["rows"] if row.get("comparison")]
    steady = [c["steady_error"] for c in compared if c["steady_error"] is not None]
    first = [c["first_error"] for c in compared if c["first_error"] is not None]
    sections = [section("Error distribution",
                        histogram(steady, _EDGES, _LABELS, f"steady peak: {len(steady)} rows", "steady"),
                        histogram(first, _EDGES, _LABELS, f"first-step peak: {len(first)} rows", "first"),
                        _distributions(data)),
                section(f"Rows ({units})", _rows(data, units))]
    if data["published"]:
        sections.append(section(f"Published runs ({units})", _published(data, units)))
    return page("zeroplan validate: accuracy", lead, sections)


def _distributions(data: dict[str, Any]) -> str:
    rows = []
    for name, found in data["distributions"].items():
        key = f"distributions.{name}"
        rows.append([text(name.replace("_", " ")), text(found.get("rows"), f"{key}.rows", ""),
                     *(Cell(percent(found.get(q)), f"{key}.{q}", found.get(q)) for q in ("median", "p90", "worst")),
                     text(found.get("worst_row"), f"{key}.worst_row")])
    return table(["peak", "rows", "median", "90th percentile", "worst", "worst row"], rows) if rows else ""


def _rows(data: dict[str, Any], units: str) -> str:
    rows = []
    for i, row in enumerate(data["rows"]):
        key, c = f"rows.{i}", row.get("comparison")
        status = Cell(row["status"], f"{key}.status", row["status"], {"ok": "ok", "miss": "miss"}.get(row["status"], "text"))
        if c is None:
            figures = [Cell("")] * 5 + [text("")]
        else:
            figures = [size(c["estimated_steady_bytes"], units, f"{key}.comparison.estimated_steady_bytes", 3),
                       size(c["measured_steady_bytes"], units, f"{key}.comparison.measured_steady_bytes", 3),
                       Cell(percent(c["steady_error"]), f"{key}.comparison.steady_error", c["steady_error"]),
                       size(c["measured_first_bytes"], units, f"{key}.comparison.measured_first_bytes", 3),
                       Cell(percent(c["first_error"]), f"{key}.comparison.first_error", c["first_error"]),
                       text(", ".join(c["misses"]), None, "wrap")]
        rows.append([text(row["id"], f"{key}.id"), status, *figures, text(row["reason"], f"{key}.reason", "wrap")])
    headers = ["row", "status", "steady est.", "steady meas.", "steady error", "first meas.", "first error", "misses", "why"]
    return table(headers, rows)


def _published(data: dict[str, Any], units: str) -> str:
    rows = [[text(run["id"], f"published.{i}.id"), text(run["figure"], f"published.{i}.figure"),
             size(run["published_bytes"], units, f"published.{i}.published_bytes", 0),
             size(run["estimate_bytes"], units, f"published.{i}.estimate_bytes", 0),
             Cell(percent(run["error"]), f"published.{i}.error", run["error"]),
             text(run["verdict"] or run["problem"], None, "wrap"), text(run["source"], f"published.{i}.source", "wrap")]
            for i, run in enumerate(data["published"])]
    return table(["run", "figure", "published", "estimate", "error", "verdict", "source"], rows) + paragraph(
        "published figures of real GPU runs, each estimated with the run's configuration")

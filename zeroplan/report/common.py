"""What every renderer shares: the output formats, the category labels, amounts in a unit, and tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zeroplan.spec.units import bytes_in_unit

FORMATS = ("table", "json", "csv", "markdown")
REPORT_FORMATS = (*FORMATS, "html")
"""The formats of estimate, compare and plan: html is one self-contained page of the JSON (report/html/)."""

CATEGORY_LABELS = {
    "params": "params",
    "grads": "grads",
    "optimizer_states": "optimizer states",
    "activations": "activations",
    "buffers": "buffers",
    "temporaries": "temporaries",
    "overhead": "overhead",
}
"""Category keys of `per_gpu` and `phases[]`, in report order, with their table labels."""


def amount(size_bytes: int, units: str, decimals: int = 2) -> str:
    """`size_bytes` in `units` (GiB = 2^30, GB = 10^9, ...), with thousands separators; the caller labels the unit."""
    return f"{bytes_in_unit(size_bytes, units):,.{decimals}f}"


def percent(error: float | None) -> str:
    """A signed relative error, e.g. +4.1%; empty where there is none (nothing was measured)."""
    return "" if error is None else f"{error:+.1%}"


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str], markdown: bool = False, left: int = 1,
          colalign: Sequence[str] | None = None, wrap: Sequence[int | None] | None = None) -> str:
    """A table whose cells are shown as given: the first `left` columns left-aligned and the rest
    right-aligned (figures), unless `colalign` says otherwise; github-flavoured in markdown. `wrap` gives
    each column's widest line (None: as wide as its text); a markdown table cannot break a cell, so it never wraps."""
    from tabulate import tabulate  # imported when a table is drawn, not for json/csv

    return tabulate(
        rows,
        headers=headers,
        tablefmt="github" if markdown else "simple",
        disable_numparse=True,
        colalign=tuple(colalign) if colalign else ("left",) * left + ("right",) * (len(headers) - left),
        maxcolwidths=None if markdown or wrap is None else list(wrap),
    )


def checkpointing_label(config: dict[str, Any]) -> str:
    """The checkpointing of a JSON `config`: its mode, and for full checkpointing of every Nth block which blocks."""
    every = config.get("checkpoint_every")
    return config["checkpointing"] + (f" (one block in {every})" if every else "")

"""What the API's functions return: each result holds what its command computed, gives the command's
`--format json` document (`to_dict()`) and renders itself as the command prints it (`render`).

The command line prints `render(format, units)` of the same object, so the JSON of the API and of
the command line are one document, built in one place (the `*_to_dict` functions of the estimate,
plan and report modules).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from zeroplan.errors import FieldError

if TYPE_CHECKING:
    from pathlib import Path

    from zeroplan.measure.comparison import Comparison as MeasuredComparison
    from zeroplan.plan.grid import Comparison
    from zeroplan.plan.search import Plan


def _checked(output_format: str, units: str, formats: tuple[str, ...]) -> None:
    from zeroplan.spec.units import REPORT_UNITS

    if output_format not in formats:
        raise FieldError("format", f"{output_format!r} is not one of {', '.join(formats)}")
    if units not in REPORT_UNITS:
        raise FieldError("units", f"{units!r} is not one of {', '.join(REPORT_UNITS)}")


def _formats() -> tuple[str, ...]:
    from zeroplan.report.common import FORMATS

    return FORMATS


class EstimateResult:
    """`zeroplan.estimate(...)`: the memory per GPU of one training configuration (on a mesh, the
    worst rank at the top level and every rank kind in `ranks`, as `zeroplan estimate` prints it)."""

    def __init__(self, data: dict[str, Any], lines: list[str] | None = None):
        self._data = data
        self._lines = lines or []  # the step and the suggestions, printed under a table or Markdown

    def to_dict(self) -> dict[str, Any]:
        """The document `zeroplan estimate --format json` prints (a copy: bytes as ints)."""
        return copy.deepcopy(self._data)

    @property
    def peak_bytes(self) -> int:
        """Bytes per GPU at the peak (the worst rank's on a mesh)."""
        return self._data["per_gpu"]["peak"]

    @property
    def fits(self) -> bool | None:
        """Whether the peak fits the GPU memory given (`gpu_memory=`); None when none was given."""
        return self._data.get("fits")

    def render(self, format: str = "table", units: str = "GiB", explain: bool = False) -> str:  # noqa: A002 - the option's name
        """As `zeroplan estimate --format FORMAT --units UNITS [--explain]` prints it: table, json, csv or markdown;
        `explain` adds the terms live at the peak (the JSON always has them)."""
        _checked(format, units, _formats())
        from zeroplan.report.estimate import render_estimate

        text = render_estimate(self._data, format, units, explain)
        if self._lines and format in ("table", "markdown"):  # JSON carries them as keys, CSV has no room
            text += "\n" + "\n".join(self._lines) + "\n"
        return text

    def __repr__(self) -> str:
        return f"<EstimateResult {self._data['model']['name']}: peak {self.peak_bytes:,} bytes per GPU>"


class CompareResult:
    """`zeroplan.compare(...)`: the per-GPU memory of a grid of ZeRO configurations."""

    def __init__(self, comparison: Comparison):
        self.comparison = comparison

    def to_dict(self) -> dict[str, Any]:
        """The document `zeroplan compare --format json` prints."""
        from zeroplan.report.compare import comparison_to_dict

        return comparison_to_dict(self.comparison)

    def render(self, format: str = "table", units: str = "GiB") -> str:  # noqa: A002
        """As `zeroplan compare --format FORMAT --units UNITS` prints it."""
        _checked(format, units, _formats())
        from zeroplan.report.compare import render_comparison

        return render_comparison(self.comparison, format, units)

    def plot(self, path: str | Path, units: str = "GiB") -> Path:
        """Draw the per-GPU breakdown as stacked bars into a PNG (`--plot FILE`; needs matplotlib)."""
        _checked("table", units, _formats())
        from zeroplan.report.plot import plot_comparison

        return plot_comparison(self.comparison, path, units)

    def __repr__(self) -> str:
        return f"<CompareResult {self.comparison.model_name}: {len(self.comparison.rows)} configurations>"


class PlanResult:
    """`zeroplan.plan(...)`: the configurations that fit, ranked by their estimated step time (with
    `mesh=True`, or a mesh given, the meshes too)."""

    def __init__(self, plan: Plan, *, assumptions: list[str] | None = None, emitted: str | None = None,
                 emit_message: str | None = None):
        self.plan = plan
        self.assumptions = list(assumptions or [])
        """Assumptions the plan made for what was not given (the command prints them on standard error)."""
        self.emitted = emitted
        """The file `emit=(kind, FILE)` wrote (the best plan's engine config), or None."""
        self.emit_message = emit_message
        """What was written and how to check it (the read-back's verdict), or None."""

    def to_dict(self) -> dict[str, Any]:
        """The document `zeroplan plan --format json` prints."""
        from zeroplan.plan.serialize import plan_to_dict

        return plan_to_dict(self.plan)

    def render(self, format: str = "table", units: str = "GiB") -> str:  # noqa: A002
        """As `zeroplan plan --format FORMAT --units UNITS` prints it."""
        _checked(format, units, _formats())
        from zeroplan.report.plan import render_plan

        return render_plan(self.to_dict(), format, units)

    def __repr__(self) -> str:
        return f"<PlanResult {self.plan.model_name}: {len(self.plan.top)} plans shown>"


class MeasureReport:
    """`zeroplan.measure(...)`: what every rank measured beside the estimate, with the errors."""

    FORMATS = ("table", "json")

    def __init__(self, data: dict[str, Any], comparison: MeasuredComparison):
        self._data, self.comparison = data, comparison

    def to_dict(self) -> dict[str, Any]:
        """The document `zeroplan measure --format json` prints and `--output FILE` writes."""
        return copy.deepcopy(self._data)

    @property
    def fits(self) -> bool:
        """False when a rank ran out of device memory (the command's exit status 3)."""
        return self._data["fits"]

    @property
    def peak_bytes(self) -> int:
        """The highest peak of any rank, in tensor bytes."""
        return self._data["peak"]

    def render(self, format: str = "table", units: str = "GiB") -> str:  # noqa: A002
        """As `zeroplan measure --format FORMAT --units UNITS` prints it: table or json."""
        _checked(format, units, self.FORMATS)
        if format == "json":
            import json

            return json.dumps(self._data, indent=2) + "\n"
        from zeroplan.report.measure import render_table

        return render_table(self._data, self.comparison, units)

    def __repr__(self) -> str:
        return f"<MeasureReport {self._data['model']}: {self._data['world_size']} ranks, peak {self.peak_bytes:,} bytes>"

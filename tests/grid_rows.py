"""One accuracy-grid row measured on gloo and held to its targets, for the tests of each knob."""

from __future__ import annotations


def measure_row_comparison(row_id: str):
    """(comparison, record) of the grid row `row_id`, measured now: its estimate against the run."""
    from zeroplan.errors import MeasureError
    from zeroplan.estimate import estimate
    from zeroplan.estimate.serialize import phase_to_dict
    from zeroplan.measure import validate as v
    from zeroplan.measure.comparison import compare, summary_peaks
    from zeroplan.measure.grid import GRID, row_specs

    (row,) = [row for row in GRID if row.id == row_id]
    record = v.measure_row(row, v.RunOptions(steps=v.DEFAULT_STEPS, timeout_s=300))
    if "failure" in record:
        raise MeasureError(record["failure"])
    model, training = row_specs(row)
    return compare([phase_to_dict(p) for p in estimate(model, training).phases], summary_peaks(record["measurement"])), record


def assert_peaks_within_targets(comparison) -> None:
    """The steady and first-step peaks within the grid's targets (measure/comparison.py TARGETS)."""
    from zeroplan.measure.comparison import TARGETS

    assert abs(comparison.steady.peak.error) <= TARGETS.steady, comparison.steady.peak
    assert abs(comparison.first.peak.error) <= TARGETS.first, comparison.first.peak

"""The CI slice of the accuracy grid (issue 4 §4): the `--quick` rows of `zeroplan.measure.grid.GRID`,
each measured for real (2 gloo ranks, or the fake backend for 8 ranks) and held to the report's
targets: steady-state peak within 3%, first-step peak within 5%, every category within 5% (above
the floor). The whole grid runs by hand: `zeroplan validate` (docs/accuracy.md).

A row with a reason in docs/accuracy_reasons.toml is a known miss: it is expected to fail
(strict), so CI stays green while it misses and fails once it is fixed, which is the cue to drop
its reason. Only a missed target counts as the expected failure: a measurement that breaks fails.
"""

import warnings

import pytest
from tests.paths import REPO

pytest.importorskip("torch")

from zeroplan.errors import MeasureError  # noqa: E402
from zeroplan.estimate import estimate  # noqa: E402
from zeroplan.estimate.serialize import phase_to_dict  # noqa: E402
from zeroplan.measure import validate as v  # noqa: E402
from zeroplan.measure.comparison import compare, summary_peaks  # noqa: E402
from zeroplan.measure.grid import GRID, Row, row_specs, select_rows  # noqa: E402
from zeroplan.report.accuracy import miss_texts, row_line  # noqa: E402

pytestmark = pytest.mark.distributed

REASONS = v.load_reasons(REPO / "docs" / "accuracy_reasons.toml")
TIMEOUT_S = 120  # per row; a healthy one takes 3-10 s on 2 cores with forked workers (measure/worker_server.py)


def _param(row: Row):
    reason = v.reason_for(row.id, REASONS)
    marks = [pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)] if reason else []
    return pytest.param(row, id=row.id, marks=marks)


@pytest.mark.parametrize("row", [_param(row) for row in select_rows(GRID, quick=True)])
def test_row_within_targets(row: Row):
    record = v.measure_row(row, v.RunOptions(steps=v.DEFAULT_STEPS, timeout_s=TIMEOUT_S))
    if record.get("failure", "").startswith("timed out"):
        # One run of tiny-llama/deepspeed-2+smallbkt hung in CI (300 s, both ranks running) and 99 runs here
        # did not: a hang is measured once more, and said with the ranks' stacks (measure/stacks.py) so that
        # it is seen; a second hang fails the test.
        warnings.warn(f"{row.id}: {record['failure']}; measured again\n{record.get('failure_detail', '')}")
        record = v.measure_row(row, v.RunOptions(steps=v.DEFAULT_STEPS, timeout_s=TIMEOUT_S))
    if "failure" in record:
        # not an AssertionError: never taken for the known miss; with the ranks' stacks of a timeout
        raise MeasureError("\n".join(filter(None, (record["failure"], record.get("failure_detail")))))
    model, training = row_specs(row)
    phases = [phase_to_dict(phase) for phase in estimate(model, training).phases]
    comparison = compare(phases, summary_peaks(record["measurement"]))
    assert miss_texts(comparison) == [], row_line(v.RowReport(row, record, comparison, ""))

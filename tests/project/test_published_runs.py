"""Published GPU runs (issue 11, item 6): each is estimated with its stated configuration, and the
report says which figure it is and how far the estimate is."""

from __future__ import annotations

from zeroplan.measure.published import RUNS, PublishedCheck, check_published


def test_every_published_run_is_estimated():
    checks = check_published()
    assert [c.run.id for c in checks] == [run.id for run in RUNS]
    assert all(c.estimate_bytes is not None for c in checks), [c.problem for c in checks if c.problem]
    for check in checks:
        assert check.run.figure in ("peak reserved", "peak active", "fits", "out of memory")
        assert (check.run.published_bytes is None) == (check.run.figure in ("fits", "out of memory"))


def test_verdicts_and_errors_follow_their_definitions():
    oom = next(run for run in RUNS if run.figure == "out of memory")
    assert PublishedCheck(oom, oom.gpu_memory_bytes + 1).verdict == "agrees: does not fit"
    assert PublishedCheck(oom, oom.gpu_memory_bytes).verdict == "disagrees: estimate says it fits"
    fits = next(run for run in RUNS if run.figure == "fits")
    assert PublishedCheck(fits, fits.gpu_memory_bytes).verdict == "agrees: fits"
    measured = next(run for run in RUNS if run.published_bytes)
    assert PublishedCheck(measured, measured.published_bytes * 2).error == 1.0

"""The one estimate-vs-measured comparison (zeroplan.measure.comparison) that `zeroplan measure`
and the accuracy grid (`zeroplan validate`) share: the error arithmetic, the rank compared, the
category floor, the targets and the CUDA counters. Hand-computed numbers; no worker process."""

import pytest

from zeroplan.estimate.result import CategoryBytes, Estimate, ModelSummary, NodeBytes, Phase, PhaseBytes, Step
from zeroplan.estimate.serialize import phase_to_dict
from zeroplan.measure.comparison import TARGETS, Line, compare, run_peaks, summary_peaks
from zeroplan.report.accuracy import miss_texts

MIB = 2**20


def _estimate(steady: CategoryBytes, first: CategoryBytes) -> Estimate:
    phases = (
        PhaseBytes(Step.FIRST, Phase.INIT, CategoryBytes(params=1)),
        PhaseBytes(Step.FIRST, Phase.OPTIMIZER_STEP, first),
        PhaseBytes(Step.STEADY, Phase.FORWARD, CategoryBytes(params=2)),
        PhaseBytes(Step.STEADY, Phase.BACKWARD, steady),
    )
    return Estimate(ModelSummary("m", 1, 1, "x"), "torch", phases, NodeBytes())


def _phases(estimate: Estimate) -> list[dict]:
    return [phase_to_dict(phase) for phase in estimate.phases]


def _rank(rank: int, steady_categories: dict, first_bytes: int, phase: str = "backward") -> dict:
    """One rank of the grid's cached summary (zeroplan.measure.validate.summarize_measurement)."""
    return {"rank": rank,
            "steady": {"step": 2, "phase": phase, "peak_bytes": sum(steady_categories.values()), "categories": steady_categories},
            "first": {"step": 1, "phase": "optimizer_step", "peak_bytes": first_bytes, "categories": {}}}


MEASURED = {"ranks": [
    _rank(0, {"params": 10 * MIB, "grads": 0, "optimizer_states": 20 * MIB, "activations": 50 * MIB, "buffers": 20 * MIB}, 90 * MIB),
    _rank(1, {"params": 10 * MIB, "optimizer_states": 20 * MIB, "activations": 40 * MIB, "buffers": 20 * MIB}, 95 * MIB),
]}


def _compare(estimate: Estimate, summary: dict = MEASURED):
    return compare(_phases(estimate), summary_peaks(summary))


def test_errors_are_estimate_over_measured_at_the_largest_rank():
    est = _estimate(CategoryBytes(params=10 * MIB, optimizer_states=20 * MIB, activations=int(51.5 * MIB), buffers=21 * MIB),
                    first=CategoryBytes(params=10 * MIB, optimizer_states=80 * MIB))
    c = _compare(est)
    steady, first = c.steady, c.first
    assert steady.rank == 0  # 100 MiB against rank 1's 90 MiB
    assert steady.peak.measured_bytes == 100 * MIB and steady.peak.estimated_bytes == int(102.5 * MIB)
    assert steady.peak.error == pytest.approx(0.025)
    assert first.peak.measured_bytes == 95 * MIB and first.rank == 1  # largest over ranks, not the steady rank's
    assert first.peak.error == pytest.approx(90 / 95 - 1)
    assert steady.categories["activations"].error == pytest.approx(0.03)
    assert steady.categories["buffers"].error == pytest.approx(0.05)
    assert miss_texts(c) == ["first step -5.3%"]


def test_category_floor_is_64_kib_or_one_percent_of_the_peak():
    # peak 100 MiB: floor 1 MiB. grads 0 measured, 0.9 MiB estimated: within the floor, not a miss.
    est = _estimate(CategoryBytes(params=10 * MIB, grads=int(0.9 * MIB), optimizer_states=20 * MIB,
                                  activations=50 * MIB, buffers=20 * MIB), first=CategoryBytes(params=95 * MIB))
    c = _compare(est)
    grads = c.steady.categories["grads"]
    assert grads.floor_bytes == MIB
    assert grads.ok and grads.below_floor
    assert c.misses() == []
    # 1.5 MiB is beyond both the floor and 5% of nothing
    est = _estimate(CategoryBytes(params=10 * MIB, grads=int(1.5 * MIB), optimizer_states=20 * MIB,
                                  activations=int(48.5 * MIB), buffers=20 * MIB), first=CategoryBytes(params=95 * MIB))
    assert miss_texts(_compare(est)) == ["grads +1.50 MiB (none measured)"]
    # a small measurement: the floor is 64 KiB
    small = Line("grads", estimated_bytes=100 * 1024, measured_bytes=40 * 1024, tolerance=TARGETS.category,
                 floor_bytes=TARGETS.category_floor_bytes)
    assert small.ok and small.error == pytest.approx(1.5)
    assert not Line("grads", 200 * 1024, 100 * 1024, TARGETS.category, TARGETS.category_floor_bytes).ok


def test_a_steady_miss_and_a_category_miss_are_both_listed():
    est = _estimate(CategoryBytes(params=10 * MIB, optimizer_states=20 * MIB, activations=40 * MIB, buffers=20 * MIB),
                    first=CategoryBytes(params=95 * MIB))
    assert miss_texts(_compare(est)) == ["peak -10.0%", "activations -20.0%"]


def test_peak_targets_are_3_percent_steady_and_5_percent_first():
    def misses(steady_mib: float, first_mib: float) -> list[str]:
        est = _estimate(CategoryBytes(buffers=int(steady_mib * MIB)), first=CategoryBytes(params=int(first_mib * MIB)))
        return [what for what, _ in _compare(est, {"ranks": [_rank(0, {"buffers": 100 * MIB}, 100 * MIB)]}).misses()]

    assert misses(102.9, 104.9) == []
    assert misses(103.1, 104.9) == ["peak"]
    assert misses(100, 94.9) == ["first step"]


def test_gpu_counters_compare_tensor_bytes_without_the_context():
    measured = {"ranks": [_rank(0, {"params": 100 * MIB}, 90 * MIB) | {"device": {
        "steady": {"allocated_peak_bytes": 110 * MIB, "reserved_peak_bytes": 128 * MIB}, "first": None}}]}
    est = _estimate(CategoryBytes(params=100 * MIB, overhead=512 * MIB), first=CategoryBytes(params=90 * MIB, overhead=512 * MIB))
    c = _compare(est, measured)
    assert c.steady.peak.error == 0 and c.first.peak.error == 0
    assert c.steady.estimated_overhead_bytes == 512 * MIB
    errors = c.steady.device_errors()
    assert errors["allocated_peak_bytes"] == pytest.approx(100 / 110 - 1)
    assert errors["reserved_peak_bytes"] == pytest.approx(100 / 128 - 1)
    assert c.first.device_peaks is None and c.first.device_errors() is None


def _run_json(summary: dict) -> dict:
    """The same ranks as a `MeasureResult.to_json_dict()` (what `zeroplan measure` compares): the
    summary's steady and first peaks as the run's per-phase `summary`, and the allocator's peaks in `phases`."""
    ranks = []
    for r in summary["ranks"]:
        device = r.get("device") or {}
        ranks.append({"rank": r["rank"], "summary": [
            {"step": step, "phase": r[step]["phase"], "peak_bytes": r[step]["peak_bytes"], "categories": r[step]["categories"]}
            for step in ("first", "steady")],
            "phases": [{"stage": stage, "device": device.get(stage)} for stage in ("first", "steady")]})
    return {"ranks": ranks}


@pytest.mark.parametrize("device", [False, True])
def test_measure_and_the_grid_give_the_same_error_for_the_same_data(device):
    """One comparison: `zeroplan measure`'s report (from the run's JSON) and the accuracy grid (from
    its cached summary) see the same numbers for the same measurement."""
    from zeroplan.report.measure import report_data

    summary = {"ranks": [dict(r) for r in MEASURED["ranks"]]}
    if device:
        for i, r in enumerate(summary["ranks"]):
            r["device"] = {"steady": {"allocated_peak_bytes": (105 + i) * MIB, "reserved_peak_bytes": 128 * MIB},
                           "first": {"allocated_peak_bytes": 99 * MIB, "reserved_peak_bytes": (120 + i) * MIB}}
    est = _estimate(CategoryBytes(params=10 * MIB, optimizer_states=20 * MIB, activations=int(51.5 * MIB), buffers=21 * MIB),
                    first=CategoryBytes(params=10 * MIB, optimizer_states=80 * MIB))
    grid = compare(_phases(est), summary_peaks(summary))
    run = compare(_phases(est), run_peaks(_run_json(summary)))
    assert run == grid
    data = report_data({"phases": _phases(est)}, {}, run)
    assert data["error"]["steady"]["peak"] == grid.steady.peak.error == pytest.approx(0.025)
    assert data["error"]["first"]["peak"] == grid.first.peak.error == pytest.approx(90 / 95 - 1)
    assert data["error"]["steady"]["activations"] == grid.steady.categories["activations"].error == pytest.approx(0.03)
    assert data["error"]["steady"]["grads"] is None  # nothing measured, nothing estimated
    if device:
        assert grid.steady.device_peaks == {"allocated_peak_bytes": 106 * MIB, "reserved_peak_bytes": 128 * MIB}
        assert data["comparison"]["first"]["device"] == {"allocated_peak_bytes": 99 * MIB, "reserved_peak_bytes": 121 * MIB}


def test_the_highest_rank_is_compared_and_a_step_no_rank_reached_is_left_out():
    def phase(step: str, name: str, **categories: int) -> dict:
        full = dict.fromkeys(("params", "grads", "optimizer_states", "activations", "buffers", "temporaries", "overhead"), 0)
        full |= categories
        return {"step": step, "phase": name, **full, "total": sum(full.values())}

    phases = [phase("first", "init", params=100, overhead=1000), phase("first", "backward", params=100, grads=100),
              phase("steady", "optimizer_step", params=100, optimizer_states=200, overhead=1000)]
    ranks = [{"rank": r, "phases": [], "summary": [
        {"step": "first", "phase": "backward", "peak_bytes": 150 + 50 * r, "categories": {"params": 100, "grads": 50 + 50 * r}}]}
        for r in (0, 1)]
    compared = compare(phases, run_peaks({"ranks": ranks}))
    assert list(compared.steps) == ["first"] and compared.steady is None  # e.g. out of memory in step 1
    first = compared.first
    assert (first.rank, first.estimated_phase, first.measured_phase) == (1, "backward", "backward")
    errors = first.errors()
    assert errors["grads"] == 0.0 and errors["params"] == 0.0
    assert errors["activations"] is None  # nothing measured
    # the estimate's overhead (CUDA context) is not a tensor: the init phase's 1100 bytes are not the tensor peak
    assert (first.peak.estimated_bytes, first.peak.measured_bytes, errors["peak"]) == (200, 200, 0.0)

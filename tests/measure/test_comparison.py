"""The one estimate-vs-measured comparison (zeroplan.measure.comparison) that `zeroplan measure`
and the accuracy grid (`zeroplan validate`) share: the error arithmetic, the rank compared, the
category floor, the targets and the CUDA counters. Hand-computed numbers; no worker process."""

import pytest

from zeroplan.estimate.result import CategoryBytes, Estimate, ModelSummary, NodeBytes, Phase, PhaseBytes, Step
from zeroplan.estimate.serialize import phase_to_dict
from zeroplan.measure.comparison import MOVE_REASONS, TARGETS, Line, Move, compare, run_peaks, summary_peaks
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


# -- categories that cancel out (issue 21) -------------------------------------------------------------


def _moves(estimated: dict, measured: dict, engine: str | None = None):
    est = _estimate(CategoryBytes(**estimated), first=CategoryBytes(**estimated))
    summary = {"ranks": [_rank(0, measured, sum(measured.values()))]}
    return compare(_phases(est), summary_peaks(summary), engine=engine)


def test_bytes_booked_in_another_category_are_a_move_not_two_errors():
    """Issue 21: `measure --engine deepspeed --zero 2` showed activations +24.6% and temporaries -100%
    beside a peak of +0.0%, without a word on why."""
    big = 1000 * MIB  # DeepSpeed's reduce bucket: its 1% floor (10 MiB) hides both category errors as misses
    estimated = {"buffers": big, "activations": int(5.859 * MIB)}
    measured = {"buffers": big, "activations": int(4.701 * MIB), "temporaries": int(1.156 * MIB)}
    c = _moves(estimated, measured, "deepspeed")
    assert c.misses() == []  # within the floor: not a miss, and yet +24.6% and -100% in the table
    assert c.steady.categories["activations"].error == pytest.approx(0.246, abs=0.001)
    reason = MOVE_REASONS[("deepspeed", "activations", "temporaries")]
    assert "DeepSpeed's estimate counts them with the activations" in reason
    assert c.steady.moves() == (Move("activations", "temporaries", int(1.156 * MIB), reason),)
    assert _moves(estimated, measured, "torch").steady.moves()[0].reason is None  # no reason is made up


def test_a_move_is_what_both_differences_share_and_needs_a_peak_that_agrees():
    c = _moves({"params": 100 * MIB, "activations": 8 * MIB, "grads": 0},
               {"params": 100 * MIB, "activations": 5 * MIB, "temporaries": 2 * MIB, "grads": 1 * MIB})
    # activations +3 MiB against temporaries -2 MiB and grads -1 MiB: the largest pair first
    assert c.steady.moves() == (Move("activations", "temporaries", 2 * MIB), Move("activations", "grads", 1 * MIB))
    c = _moves({"activations": 8 * MIB}, {"activations": 5 * MIB, "temporaries": 2 * MIB})  # peak +14%: a miss
    assert c.steady.moves() == ()
    c = _moves({"activations": 100 * MIB}, {"activations": 103 * MIB})  # one way only
    assert c.steady.moves() == ()
    c = _moves({"activations": 100 * MIB + 60 * 1024}, {"activations": 100 * MIB, "temporaries": 60 * 1024})
    assert c.steady.moves() == ()  # below 64 KiB: too small to name


def test_measure_says_which_categories_moved_and_why():
    from zeroplan.report.measure import render_table, report_data

    big = 1000 * MIB
    est = _estimate(CategoryBytes(buffers=big, activations=6 * MIB), first=CategoryBytes(buffers=big, activations=6 * MIB))
    summary = {"ranks": [_rank(0, {"buffers": big, "activations": 5 * MIB, "temporaries": MIB}, big + 6 * MIB)]}
    c = compare(_phases(est), run_peaks(_run_json(summary)), engine="deepspeed")
    estimate = {"phases": _phases(est), "model": {"implementation": "x"},
                "config": {"precision": "fp32", "optimizer": "adamw", "micro_batch": 2, "seq_len": 128, "grad_accum": 1,
                           "checkpointing": "none", "offload_optimizer": "none", "offload_params": "none"}}
    measured = {"engine": "deepspeed", "zero_stage": 2, "world_size": 2, "backend": "gloo", "device": "cpu",
                "implementation": "x", "model": "m", "steps": 2, "fits": True, "ranks": [], "notes": []}
    data = report_data(estimate, measured, c)
    assert data["comparison"]["steady"]["moves"] == [{"estimated_as": "activations", "measured_as": "temporaries",
                                                      "bytes": MIB, "reason": MOVE_REASONS[("deepspeed", "activations",
                                                                                            "temporaries")]}]
    text = render_table(data, c, "MiB")
    (line,) = [line for line in text.splitlines() if line.startswith("activations -> temporaries")]
    assert line.startswith("activations -> temporaries, 1.000 MiB in the steady state: "  # the first step has no categories
                           "bytes the estimate counts as activations were temporaries in the run, and the peaks agree; "
                           "gradients of activations in flight at the backward peak")
    text = render_table(data, compare(_phases(est), run_peaks(_run_json(summary)), engine="torch"), "MiB")
    assert text.splitlines()[-1].endswith("were temporaries in the run, and the peaks agree")  # no reason made up


def test_validate_names_the_move_in_its_progress_line():
    from zeroplan.measure.grid import GRID
    from zeroplan.measure.validate import RowReport
    from zeroplan.report.accuracy import row_line

    c = _moves({"params": 10 * MIB, "activations": 6 * MIB}, {"params": 10 * MIB, "activations": 5 * MIB, "temporaries": MIB})
    line = row_line(RowReport(GRID[0], {"seconds": 4.0}, c, ""))
    assert line.endswith("-- activations +20.0%; temporaries -100.0% (moved between categories: activations -> "
                         "temporaries 1.00 MiB) [4 s]")

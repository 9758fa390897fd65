"""Estimate beside measurement: the one comparison `zeroplan measure` and the accuracy grid share.

Both sides come in as plain data:
- the estimate's phases as `zeroplan estimate --format json` has them (`phases`, made by
  `zeroplan.estimate.serialize.phase_to_dict`);
- per step, each rank's highest phase (`RankPeak`): `run_peaks` reads them from a
  `MeasureResult.to_json_dict()`, `summary_peaks` from the grid's cached summary
  (`zeroplan.measure.validate.summarize_measurement`).

Definitions (docs/accuracy.md and docs/measure.md say the same):
- a step is "steady" (steps 2 and later, optimizer states exist) or "first" (model and engine
  set-up, then step 1);
- measured peak of a step: the highest phase peak of that step on the rank that peaks highest;
  the categories compared are that rank's at that phase;
- estimated peak of a step: the estimate's highest phase of that step, in tensor bytes: the
  estimate's `overhead` (CUDA context, fragmentation) is not a tensor and the accounting cannot
  see it, so it is left out of the comparison and reported on its own;
- error = estimate / measured - 1 (positive: the estimate is too high); None where nothing was
  measured;
- targets (issue 4 §3): the steady peak within 3%, the first-step peak within 5%, every category
  within 5%; a category misses only when |estimate - measured| exceeds both 5% of the measured
  bytes and the floor (64 KiB, or 1% of the step's measured peak if larger), so that a category
  of a few bytes on both sides is not a miss;
- moved bytes (`StepComparison.moves`): where the peak meets its target, a category the estimate
  puts too high and another it puts too low are the same bytes booked in one category by the
  estimate and in the other by the run (up to the smaller of the two differences); each move says
  from which to which, with the reason where it is known (`MOVE_REASONS`).
Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from zeroplan.estimate.result import TENSOR_CATEGORIES as CATEGORIES  # the estimate's overhead is not a tensor

STEPS = ("steady", "first")
DEVICE_COUNTERS = ("allocated_peak_bytes", "reserved_peak_bytes")  # torch.cuda max_memory_allocated / reserved


@dataclass(frozen=True)
class Targets:
    """How close the estimate must come (issue 4 §3)."""

    steady: float = 0.03  # the steady-state peak
    first: float = 0.05  # the first-step peak
    category: float = 0.05  # every category of a step's peak ...
    category_floor_bytes: int = 64 * 2**10  # ... beyond 64 KiB ...
    category_floor_fraction: float = 0.01  # ... or 1% of the step's measured peak, whichever is larger

    def peak_tolerance(self, step: str) -> float:
        return self.steady if step == "steady" else self.first

    def floor_bytes(self, measured_peak_bytes: int) -> int:
        return max(self.category_floor_bytes, int(self.category_floor_fraction * measured_peak_bytes))


TARGETS = Targets()


def relative_error(estimated_bytes: int, measured_bytes: int) -> float | None:
    """estimate / measured - 1; None when nothing was measured."""
    return estimated_bytes / measured_bytes - 1 if measured_bytes else None


@dataclass(frozen=True)
class Line:
    """One line of a step's comparison: a category, or "peak" (which has no floor)."""

    name: str
    estimated_bytes: int
    measured_bytes: int
    tolerance: float
    floor_bytes: int = 0

    @property
    def error(self) -> float | None:
        return relative_error(self.estimated_bytes, self.measured_bytes)

    @property
    def below_floor(self) -> bool:
        """Both sides below the floor: too small to judge."""
        return self.estimated_bytes < self.floor_bytes and self.measured_bytes < self.floor_bytes

    @property
    def ok(self) -> bool:
        allowed = max(self.tolerance * self.measured_bytes, self.floor_bytes)
        return abs(self.estimated_bytes - self.measured_bytes) <= allowed


@dataclass(frozen=True)
class RankPeak:
    """One rank's highest phase of a step, with the categories at it and the CUDA allocator's
    peaks over the step's phases (None on CPU)."""

    rank: int
    phase: str
    peak_bytes: int
    categories: Mapping[str, int] = field(default_factory=dict)
    device: Mapping[str, int] | None = None


@dataclass(frozen=True)
class Move:
    """Bytes the estimate books as `estimated_as` that the run booked as `measured_as`, and why where
    it is known (`MOVE_REASONS`)."""

    estimated_as: str
    measured_as: str
    moved_bytes: int
    reason: str | None = None


MOVE_REASONS = {
    ("deepspeed", "activations", "temporaries"): (
        "gradients of activations in flight at the backward peak (a block's, or the loss's): the run counts what "
        "backward allocates as temporaries (measure/accounting.py), DeepSpeed's estimate counts them with the "
        "activations (estimate/engines/deepspeed.py `_activation_along`, `_backward_start`), where the torch and "
        "fsdp2 estimates book them as temporaries (activations/transformer.py `block_backward_temporary_at`, "
        "`logits_grad`)"),
}
"""Why an engine's estimate and its run book the same bytes in different categories, by (engine,
the estimate's category, the run's category)."""


@dataclass(frozen=True)
class StepComparison:
    """The estimate against the measurement for one step ("steady" or "first")."""

    step: str
    rank: int  # the rank whose peak is the highest: its categories are compared
    estimated_phase: str
    measured_phase: str
    lines: tuple[Line, ...]  # one per category, then "peak"
    rank_peaks: tuple[RankPeak, ...]  # every rank's peak in this step
    estimated_overhead_bytes: int  # the estimate's non-tensor bytes, left out of the lines
    device_peaks: dict[str, int] | None = None  # CUDA allocator peaks (max over ranks), None on CPU
    engine: str | None = None  # the engine run, for the reasons of moves between categories

    @property
    def peak(self) -> Line:
        return self.lines[-1]

    @property
    def categories(self) -> dict[str, Line]:
        return {line.name: line for line in self.lines[:-1]}

    def errors(self) -> dict[str, float | None]:
        return {line.name: line.error for line in self.lines}

    def moves(self, floor_bytes: int = TARGETS.category_floor_bytes) -> tuple[Move, ...]:
        """The categories that differ (beyond their tolerance and `floor_bytes`, whatever the peak:
        a large peak's floor hides a category error of +25% that the table still shows), paired
        where the peak meets its target (module docstring): the largest over-estimate with the
        largest under-estimate, and so on, each move the bytes both have; what is left of either
        is the peak's own difference. Empty when the peak misses or nothing differs both ways."""
        missed = [line for line in self.categories.values()
                  if abs(line.estimated_bytes - line.measured_bytes) > max(line.tolerance * line.measured_bytes, floor_bytes)]
        over = {line.name: line.estimated_bytes - line.measured_bytes for line in missed
                if line.estimated_bytes > line.measured_bytes}
        under = {line.name: line.measured_bytes - line.estimated_bytes for line in missed
                 if line.measured_bytes > line.estimated_bytes}
        if not self.peak.ok or not over or not under:
            return ()
        moves = []
        while over and under:
            high, low = max(over, key=over.get), max(under, key=under.get)
            moved = min(over[high], under[low])
            moves.append(Move(high, low, moved, MOVE_REASONS.get((self.engine, high, low))))
            over[high] -= moved
            under[low] -= moved
            over = {name: left for name, left in over.items() if left > 0}
            under = {name: left for name, left in under.items() if left > 0}
        return tuple(moves)

    def device_errors(self) -> dict[str, float | None] | None:
        """The estimated tensor peak against each CUDA allocator peak, None on CPU."""
        if self.device_peaks is None:
            return None
        return {name: relative_error(self.peak.estimated_bytes, self.device_peaks[name]) for name in DEVICE_COUNTERS}


@dataclass(frozen=True)
class Comparison:
    """Every step a run reached, estimate against measurement."""

    steps: dict[str, StepComparison]  # in STEPS order; a step no rank reached is absent

    @property
    def steady(self) -> StepComparison | None:
        return self.steps.get("steady")

    @property
    def first(self) -> StepComparison | None:
        return self.steps.get("first")

    @property
    def line_names(self) -> tuple[str, ...]:
        """The lines of every step, in order: the categories, then "peak"."""
        return (*CATEGORIES, "peak")

    def misses(self) -> list[tuple[str, Line]]:
        """What misses the targets, as (what, line): "peak" (the steady peak), "first step", then
        the steady peak's categories; empty when every target is met."""
        peaks = [("peak" if c.step == "steady" else "first step", c.peak) for c in self.steps.values()]
        categories = list(self.steady.categories.items()) if self.steady else []
        return [(what, line) for what, line in peaks + categories if not line.ok]


def device_peaks(counters: Iterable[Mapping[str, int] | None]) -> dict[str, int] | None:
    """The highest of each CUDA allocator counter over `counters`, None when there are none (CPU)."""
    found = [c for c in counters if c]
    if not found:
        return None
    return {name: max(c.get(name, 0) for c in found) for name in DEVICE_COUNTERS}


def _estimated_step_peak(phases: Sequence[Mapping[str, Any]], step: str) -> Mapping[str, Any]:
    """The estimate's highest phase of `step` in tensor bytes (the overhead is the same in every
    phase, so this is `Estimate.peak_of`; the first one wins a tie, as there)."""
    return max((p for p in phases if p["step"] == step), key=lambda p: p["total"] - p["overhead"])


def compare_step(phases: Sequence[Mapping[str, Any]], peaks: Sequence[RankPeak], step: str,
                 targets: Targets = TARGETS, engine: str | None = None) -> StepComparison | None:
    """`step` of the estimate's `phases` against each rank's measured peak of it, for a run of `engine`;
    None when no rank reached that step (a run that ran out of memory early)."""
    if not peaks:
        return None
    top = max(peaks, key=lambda p: p.peak_bytes)
    est = _estimated_step_peak(phases, step)
    floor = targets.floor_bytes(top.peak_bytes)
    lines = [Line(name, int(est[name]), int(top.categories.get(name, 0)), targets.category, floor) for name in CATEGORIES]
    lines.append(Line("peak", int(est["total"]) - int(est["overhead"]), int(top.peak_bytes), targets.peak_tolerance(step)))
    return StepComparison(
        step=step,
        rank=top.rank,
        estimated_phase=est["phase"],
        measured_phase=top.phase,
        lines=tuple(lines),
        rank_peaks=tuple(peaks),
        estimated_overhead_bytes=int(est["overhead"]),
        device_peaks=device_peaks([p.device for p in peaks]) if all(p.device for p in peaks) else None,
        engine=engine,
    )


def compare(phases: Sequence[Mapping[str, Any]], peaks: Mapping[str, Sequence[RankPeak]],
            targets: Targets = TARGETS, engine: str | None = None) -> Comparison:
    """Every step of `peaks` (by step, as `run_peaks` and `summary_peaks` give them) against the estimate's
    `phases`; `engine` (the engine run) gives the moves between categories their reasons."""
    compared = {step: compare_step(phases, peaks.get(step, ()), step, targets, engine) for step in STEPS}
    return Comparison({step: c for step, c in compared.items() if c is not None})


def run_peaks(measured: Mapping[str, Any]) -> dict[str, list[RankPeak]]:
    """Per step, each rank's peak in a `MeasureResult.to_json_dict()`: its highest phase of the
    step from `summary` (init phases belong to the first step), the allocator's peaks from `phases`."""
    out: dict[str, list[RankPeak]] = {}
    for step in STEPS:
        stages = ("init", "first") if step == "first" else ("steady",)
        out[step] = []
        for rank in measured["ranks"]:
            found = [p for p in rank["summary"] if p["step"] == step]
            if not found:
                continue
            best = max(found, key=lambda p: p["peak_bytes"])
            counters = device_peaks(p.get("device") for p in rank["phases"] if p["stage"] in stages)
            out[step].append(RankPeak(rank["rank"], best["phase"], int(best["peak_bytes"]), best["categories"], counters))
    return out


def summary_peaks(summary: Mapping[str, Any]) -> dict[str, list[RankPeak]]:
    """Per step, each rank's peak in the accuracy grid's cached summary: `ranks[]` with `steady`
    and `first` (the highest phase of each) and, on CUDA, `device` (the allocator's peaks per step)."""
    return {
        step: [RankPeak(r["rank"], r[step]["phase"], int(r[step]["peak_bytes"]), r[step]["categories"],
                        (r.get("device") or {}).get(step))
               for r in summary["ranks"] if r.get(step)]
        for step in STEPS
    }

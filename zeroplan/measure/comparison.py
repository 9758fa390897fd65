"""Estimate beside measurement: one configuration's estimate set against what its ranks measured.

Works on plain JSON data, so that a local run (`MeasureResult.to_json_dict()`) and the assembled
outputs of a torchrun launch compare the same way:
- the estimate is `zeroplan.estimate.serialize.estimate_to_dict` (`zeroplan estimate --format json`);
- the measurement is `zeroplan.measure.result.MeasureResult.to_json_dict()`.

Definitions (the same as docs/accuracy.md, zeroplan/measure/validate.py):
- a step is "steady" (steps 2 and later, optimizer states exist) or "first" (model and engine
  set-up, then step 1);
- measured peak of a step: the highest phase peak of that step on the rank that peaks highest;
  the categories compared are that rank's at that phase;
- estimated peak of a step: the estimate's highest phase of that step, in tensor bytes: the
  estimate's `overhead` (CUDA context, fragmentation) is not a tensor and the accounting cannot
  see it, so it is left out of the comparison and reported on its own;
- error = estimate / measured - 1 (positive: the estimate is too high); None where nothing was
  measured.
Nothing here imports torch or click.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CATEGORIES = ("params", "grads", "optimizer_states", "activations", "buffers", "temporaries")
"""The categories the accounting records (result.py), in report order; the estimate's overhead is not one."""

STEPS = ("steady", "first")

_LABELS = {"optimizer_states": "optimizer states", "steady": "steady state", "first": "first step"}


def relative_error(estimated_bytes: int, measured_bytes: int) -> float | None:
    """estimate / measured - 1; None when nothing was measured."""
    return estimated_bytes / measured_bytes - 1 if measured_bytes else None


@dataclass(frozen=True)
class Line:
    """One row of the comparison: a category, or "peak"."""

    name: str
    estimated_bytes: int
    measured_bytes: int

    @property
    def error(self) -> float | None:
        return relative_error(self.estimated_bytes, self.measured_bytes)


@dataclass(frozen=True)
class RankPeak:
    rank: int
    phase: str
    peak_bytes: int


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

    @property
    def peak(self) -> Line:
        return self.lines[-1]

    def errors(self) -> dict[str, float | None]:
        return {line.name: line.error for line in self.lines}


def _estimated_step_peak(estimate: dict[str, Any], step: str) -> dict[str, Any]:
    """The estimate's highest phase of `step` in tensor bytes (the overhead is the same in every
    phase of a run, so this is `Estimate.peak_of`; the first one wins a tie, as there)."""
    phases = [p for p in estimate["phases"] if p["step"] == step]
    return max(phases, key=lambda p: p["total"] - p["overhead"])


def _measured_step_peak(rank: dict[str, Any], step: str) -> dict[str, Any] | None:
    """The rank's highest phase of `step` from its summary (init phases belong to the first step)."""
    found = [p for p in rank["summary"] if p["step"] == step]
    return max(found, key=lambda p: p["peak_bytes"]) if found else None


def _device_peaks(ranks: list[dict[str, Any]], step: str) -> dict[str, int] | None:
    stages = ("init", "first") if step == "first" else ("steady",)
    devices = [p["device"] for r in ranks for p in r["phases"] if p.get("device") and p["stage"] in stages]
    if not devices:
        return None
    return {key: max(d.get(key, 0) for d in devices) for key in ("allocated_peak_bytes", "reserved_peak_bytes")}


def compare_step(estimate: dict[str, Any], measured: dict[str, Any], step: str) -> StepComparison | None:
    """`step` of the estimate against the measurement; None when no rank reached that step (a
    run that ran out of memory early)."""
    peaks = [(rank, _measured_step_peak(rank, step)) for rank in measured["ranks"]]
    peaks = [(rank, peak) for rank, peak in peaks if peak is not None]
    if not peaks:
        return None
    top_rank, top = max(peaks, key=lambda item: item[1]["peak_bytes"])
    est = _estimated_step_peak(estimate, step)
    lines = [Line(name, int(est[name]), int(top["categories"].get(name, 0))) for name in CATEGORIES]
    lines.append(Line("peak", int(est["total"]) - int(est["overhead"]), int(top["peak_bytes"])))
    return StepComparison(
        step=step,
        rank=top_rank["rank"],
        estimated_phase=est["phase"],
        measured_phase=top["phase"],
        lines=tuple(lines),
        rank_peaks=tuple(RankPeak(rank["rank"], peak["phase"], int(peak["peak_bytes"])) for rank, peak in peaks),
        estimated_overhead_bytes=int(est["overhead"]),
        device_peaks=_device_peaks(measured["ranks"], step),
    )


def compare_measurement(estimate: dict[str, Any], measured: dict[str, Any]) -> dict[str, StepComparison]:
    """Every step the run reached ("steady", "first"), estimate against measurement."""
    compared = {step: compare_step(estimate, measured, step) for step in STEPS}
    return {step: c for step, c in compared.items() if c is not None}


def report_data(estimate: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """The JSON of `zeroplan measure`: the measurement's JSON, plus `estimate` (the estimate's
    JSON), `error` (per step: each category and the peak, estimate / measured - 1, null where
    nothing was measured) and `comparison` (per step: the rank compared, both phases, and the
    bytes behind each error)."""
    compared = compare_measurement(estimate, measured)
    return {
        **measured,
        "estimate": estimate,
        "error": {step: c.errors() for step, c in compared.items()},
        "comparison": {
            step: {
                "rank": c.rank,
                "estimated_phase": c.estimated_phase,
                "measured_phase": c.measured_phase,
                "estimated": {line.name: line.estimated_bytes for line in c.lines},
                "measured": {line.name: line.measured_bytes for line in c.lines},
                "estimated_overhead": c.estimated_overhead_bytes,
                "rank_peaks": [{"rank": p.rank, "phase": p.phase, "peak": p.peak_bytes} for p in c.rank_peaks],
                **({"device": c.device_peaks} if c.device_peaks else {}),
            }
            for step, c in compared.items()
        },
    }


# --------------------------------------------------------------------------------------------
# The table


def _amount(size_bytes: int, units: str) -> str:
    from zeroplan.spec.units import bytes_in_unit

    value = bytes_in_unit(size_bytes, units)
    return f"{value:,.3f}"


def _pct(error: float | None) -> str:
    return "" if error is None else f"{error:+.1%}"


def _header(data: dict[str, Any]) -> list[str]:
    config = data["estimate"]["config"]
    where = f"{data['world_size']} simulated ranks (fake backend)" if data["backend"] == "fake" else (
        f"{data['world_size']} ranks ({data['backend']}, {data['device']})")
    setup = [f"{data['engine']} ZeRO-{data['zero_stage']}", where, config["precision"], config["optimizer"],
             f"micro-batch {config['micro_batch']} x {config['seq_len']} tokens"]
    if config["grad_accum"] > 1:
        setup.append(f"grad-accum {config['grad_accum']}")
    if config["checkpointing"] != "none":
        setup.append(f"checkpointing {config['checkpointing']}")
    for what in ("optimizer", "params"):
        if config[f"offload_{what}"] != "none":
            setup.append(f"{what} offload {config[f'offload_{what}']}")
    setup.append(f"{data['steps']} steps")
    return [
        f"{data['model']}: " + ", ".join(setup),
        f"measured: {data['implementation']}; estimated: {data['estimate']['model']['implementation']}",
    ]


def render_table(data: dict[str, Any], units: str = "GiB") -> str:
    """`report_data` as text: the categories at the peak and the peak, estimate beside
    measurement with the error, for the steady state and the first step; the peak's phase; each
    rank's peak; the CUDA allocator's peaks where measured; notes."""
    from tabulate import tabulate

    compared = _comparisons(data)
    headers = [units, *(f"{step} {what}" for step in compared for what in ("est.", "meas.", "error"))]
    rows = []
    for i, name in enumerate((*CATEGORIES, "peak")):
        row = [_LABELS.get(name, name)]
        for c in compared.values():
            line = c.lines[i]
            row += [_amount(line.estimated_bytes, units), _amount(line.measured_bytes, units), _pct(line.error)]
        rows.append(row)
    rows.append(["peak phase", *(x for c in compared.values() for x in (c.estimated_phase, c.measured_phase, ""))])
    table = tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True,
                     colalign=("left",) + ("right",) * (len(headers) - 1))
    out = _header(data) + ["steady: steps 2 and later; first: set-up and step 1; error = estimate / measured - 1", "", table, ""]
    for c in compared.values():
        ranks = ", ".join(f"rank {p.rank} {_amount(p.peak_bytes, units)} {units} ({p.phase})" for p in c.rank_peaks)
        out.append(f"{_LABELS[c.step]} peak per rank: {ranks}; categories above are rank {c.rank}'s")
    for c in compared.values():
        if c.device_peaks:
            allocated, reserved = c.device_peaks["allocated_peak_bytes"], c.device_peaks["reserved_peak_bytes"]
            out.append(f"{_LABELS[c.step]} CUDA allocator: max allocated {_amount(allocated, units)} {units} "
                       f"(estimate {_pct(relative_error(c.peak.estimated_bytes, allocated))}), "
                       f"max reserved {_amount(reserved, units)} {units}")
    overhead = max((c.estimated_overhead_bytes for c in compared.values()), default=0)
    if overhead:
        out.append(f"the estimate's overhead ({_amount(overhead, units)} {units}: CUDA context, fragmentation) "
                   "is not a tensor and is left out of the comparison")
    if not data["fits"]:
        out.append(_oom_line(data, units))
    notes = list(data.get("notes", []))
    if notes:
        out += ["", "Notes:"] + [f"- {note}" for note in notes]
    return "\n".join(out) + "\n"


def _comparisons(data: dict[str, Any]) -> dict[str, StepComparison]:
    return compare_measurement(data["estimate"], {"ranks": data["ranks"]})


def _oom_line(data: dict[str, Any], units: str) -> str:
    failed = [r for r in data["ranks"] if not r["fits"]]
    parts = [f"rank {r['rank']} at {r['phases'][-1]['phase'] if r['phases'] else 'start'} "
             f"({r['oom_message']}), peak reached {_amount(r['peak'], units)} {units}" for r in failed]
    return "DOES NOT FIT: ran out of device memory: " + "; ".join(parts)

"""The report of `zeroplan measure`: its JSON document and its table, from the run's JSON, the
estimate's JSON and their `Comparison` (zeroplan.measure.comparison). Formatting only."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zeroplan.report.common import CATEGORY_LABELS, amount, checkpointing_label, percent, table

if TYPE_CHECKING:
    from zeroplan.measure.comparison import Comparison

_STEP_LABELS = {"steady": "steady state", "first": "first step"}


def report_data(estimate: dict[str, Any], measured: dict[str, Any], comparison: Comparison) -> dict[str, Any]:
    """The JSON of `zeroplan measure`: the measurement's JSON, plus `estimate` (the estimate's
    JSON), `error` (per step: each category and the peak, estimate / measured - 1, null where
    nothing was measured) and `comparison` (per step: the rank compared, both phases, the
    bytes behind each error, and the bytes booked in another category than the estimate's)."""
    compared = comparison.steps
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
                "moves": [{"estimated_as": m.estimated_as, "measured_as": m.measured_as, "bytes": m.moved_bytes,
                           "reason": m.reason} for m in c.moves()],
                **({"device": c.device_peaks} if c.device_peaks else {}),
            }
            for step, c in compared.items()
        },
    }


def _amount(size_bytes: int, units: str) -> str:
    return amount(size_bytes, units, decimals=3)


def _header(data: dict[str, Any]) -> list[str]:
    config = data["estimate"]["config"]
    where = f"{data['world_size']} simulated ranks (fake backend)" if data["backend"] == "fake" else (
        f"{data['world_size']} ranks ({data['backend']}, {data['device']})")
    setup = [f"{data['engine']} ZeRO-{data['zero_stage']}", where, config["precision"], config["optimizer"],
             f"micro-batch {config['micro_batch']} x {config['seq_len']} tokens"]
    if config["grad_accum"] > 1:
        setup.append(f"grad-accum {config['grad_accum']}")
    if config["checkpointing"] != "none":
        setup.append(f"checkpointing {checkpointing_label(config)}")
    for what in ("optimizer", "params"):
        if config[f"offload_{what}"] != "none":
            setup.append(f"{what} offload {config[f'offload_{what}']}")
    setup.append(f"{data['steps']} steps")
    return [
        f"{data['model']}: " + ", ".join(setup),
        f"measured: {data['implementation']}; estimated: {data['estimate']['model']['implementation']}",
    ]


def render_table(data: dict[str, Any], comparison: Comparison, units: str = "GiB") -> str:
    """`report_data` as text: the categories at the peak and the peak, estimate beside
    measurement with the error, for the steady state and the first step; the peak's phase; each
    rank's peak; the CUDA allocator's peaks where measured; notes."""
    compared = comparison.steps
    headers = [units, *(f"{step} {what}" for step in compared for what in ("est.", "meas.", "error"))]
    rows = []
    for i, name in enumerate(comparison.line_names):
        row = [CATEGORY_LABELS.get(name, name)]
        for c in compared.values():
            line = c.lines[i]
            row += [_amount(line.estimated_bytes, units), _amount(line.measured_bytes, units), percent(line.error)]
        rows.append(row)
    rows.append(["peak phase", *(x for c in compared.values() for x in (c.estimated_phase, c.measured_phase, ""))])
    out = _header(data) + ["steady: steps 2 and later; first: set-up and step 1; error = estimate / measured - 1", "",
                           table(rows, headers), ""]
    for c in compared.values():
        ranks = ", ".join(f"rank {p.rank} {_amount(p.peak_bytes, units)} {units} ({p.phase})" for p in c.rank_peaks)
        out.append(f"{_STEP_LABELS[c.step]} peak per rank: {ranks}; categories above are rank {c.rank}'s")
    for c in compared.values():
        if c.device_peaks:
            allocated, reserved = c.device_peaks["allocated_peak_bytes"], c.device_peaks["reserved_peak_bytes"]
            out.append(f"{_STEP_LABELS[c.step]} CUDA allocator: max allocated {_amount(allocated, units)} {units} "
                       f"(estimate {percent(c.device_errors()['allocated_peak_bytes'])}), "
                       f"max reserved {_amount(reserved, units)} {units}")
    out += _move_lines(comparison, units)
    out += _param_parts_lines(data, comparison, units)
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


def _move_lines(comparison: Comparison, units: str) -> list[str]:
    """One line per pair of categories that cancel out (StepComparison.moves), its bytes in each step."""
    moved: dict[tuple[str, str], list[str]] = {}
    reasons = {}
    for c in comparison.steps.values():
        for move in c.moves():
            key = (move.estimated_as, move.measured_as)
            moved.setdefault(key, []).append(f"{_amount(move.moved_bytes, units)} {units} in the {_STEP_LABELS[c.step]}")
            reasons[key] = move.reason
    lines = []
    for (estimated_as, measured_as), amounts in moved.items():
        est, run = CATEGORY_LABELS[estimated_as], CATEGORY_LABELS[measured_as]
        reason = reasons[(estimated_as, measured_as)]
        lines.append(f"{est} -> {run}, {' and '.join(amounts)}: bytes the estimate counts as {est} were {run} in the run, "
                     f"and the peaks agree" + (f"; {reason}" if reason else ""))
    return lines


def measured_param_parts(data: dict[str, Any], comparison: Comparison) -> dict[str, dict[str, int]]:
    """Per step, the compared rank's params at its peak as base and adapter bytes (LoRA runs only)."""
    parts = {}
    for step, c in comparison.steps.items():
        rank = next((r for r in data["ranks"] if r["rank"] == c.rank), None)
        rows = [row for row in (rank or {}).get("summary", ()) if row["step"] == step and "params_split" in row]
        if rows:
            parts[step] = max(rows, key=lambda row: row["peak_bytes"])["params_split"]
    return parts


def _param_parts_lines(data: dict[str, Any], comparison: Comparison, units: str) -> list[str]:
    estimated = data["estimate"].get("param_parts")
    lines = []
    for step, measured in measured_param_parts(data, comparison).items():
        est = (f" (estimate base {_amount(estimated['base'], units)}, adapter {_amount(estimated['adapter'], units)})"
               if estimated else "")
        lines.append(f"{_STEP_LABELS[step]} params measured: base {_amount(measured['base'], units)} {units}, "
                     f"adapter {_amount(measured['adapter'], units)} {units}{est}")
    return lines


def _oom_line(data: dict[str, Any], units: str) -> str:
    failed = [r for r in data["ranks"] if not r["fits"]]
    parts = [f"rank {r['rank']} at {r['phases'][-1]['phase'] if r['phases'] else 'start'} "
             f"({r['oom_message']}), peak reached {_amount(r['peak'], units)} {units}" for r in failed]
    return "DOES NOT FIT: ran out of device memory: " + "; ".join(parts)

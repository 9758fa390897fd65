"""`zeroplan measure --format html`: the estimate beside what the ranks measured, step by step and category by
category with the error, every rank's peak, the compared rank's phases, and the allocator's figures."""

from __future__ import annotations

from typing import Any

from zeroplan.report.common import CATEGORY_LABELS, percent
from zeroplan.report.estimate import estimate_header
from zeroplan.report.html.page import (
    Bar,
    Cell,
    category_parts,
    legend,
    notes,
    page,
    paragraph,
    section,
    size,
    stacked_bars,
    table,
    text,
)

_STEPS = {"steady": "steady state (steps 2 and later)", "first": "first step (set-up and step 1)"}


def measure_page(data: dict[str, Any], units: str = "GiB") -> str:
    """`data` from `report_data` (what `zeroplan measure --format json` prints and `--output` writes)."""
    where = (f"{data['world_size']} simulated ranks (fake backend)" if data["backend"] == "fake"
             else f"{data['world_size']} ranks ({data['backend']}, {data['device']})")
    lead = [f"measured: {data['engine']} ZeRO-{data['zero_stage']} on {where}, {data['steps']} steps; "
            f"{data['implementation']}", "estimated: " + "; ".join(estimate_header(data["estimate"])[1:]),
            "error = estimate / measured - 1" + ("" if data["fits"] else "; a rank ran out of device memory")]
    sections = [_step_section(data, step, units) for step in data["comparison"]]
    sections += [_ranks_section(data, units), _phases_section(data, units), _replay_section(data, units)]
    moves = [[text(move["estimated_as"], f"comparison.{step}.moves.{i}.estimated_as"),
              text(move["measured_as"], f"comparison.{step}.moves.{i}.measured_as"),
              size(move["bytes"], units, f"comparison.{step}.moves.{i}.bytes", 3),
              text(move["reason"], f"comparison.{step}.moves.{i}.reason", "wrap")]
             for step, compared in data["comparison"].items() for i, move in enumerate(compared["moves"])]
    if moves:
        sections.append(section("Bytes the estimate books in another category (the peaks agree)",
                                table(["estimated as", "measured as", units, "why"], moves)))
    if data.get("notes"):
        sections.append(section("Notes", notes(data["notes"])))
    return page(f"zeroplan measure: {data['model']}", lead, sections)


def _step_section(data: dict[str, Any], step: str, units: str) -> str:
    """One step: the estimate's bar beside the measured one, and the table of both with the error."""
    compared, errors = data["comparison"][step], data["error"][step]
    key = f"comparison.{step}"
    bars = [Bar(f"estimated ({compared['estimated_phase']})", category_parts(compared["estimated"], f"{key}.estimated"),
                compared["estimated"]["peak"], f"{key}.estimated.peak"),
            Bar(f"measured, rank {compared['rank']} ({compared['measured_phase']})",
                category_parts(compared["measured"], f"{key}.measured"), compared["measured"]["peak"],
                f"{key}.measured.peak")]
    rows = []
    for name in [c for c in CATEGORY_LABELS if c in compared["estimated"]] + ["peak"]:
        error = errors.get(name)
        rows.append([text(CATEGORY_LABELS.get(name, name)), size(compared["estimated"][name], units, f"{key}.estimated.{name}", 3),
                     size(compared["measured"][name], units, f"{key}.measured.{name}", 3),
                     Cell(percent(error), f"error.{step}.{name}", error)])
    parts = [legend(CATEGORY_LABELS), stacked_bars(bars, units), table(["category", "estimated", "measured", "error"], rows)]
    if compared.get("estimated_overhead"):
        parts.append(paragraph(f"the estimate's overhead ({compared['estimated_overhead']:,} bytes: CUDA context, "
                               "NCCL buffers) is not a tensor and is left out of the comparison"))
    device = compared.get("device")
    if device:
        parts.append(table(["CUDA allocator (max over ranks)", units],
                           [[text(name), size(value, units, f"{key}.device.{name}", 3)] for name, value in device.items()]))
    return section(f"Estimate beside measured: {_STEPS.get(step, step)} ({units})", *parts)


def _ranks_section(data: dict[str, Any], units: str) -> str:
    ranks = data["ranks"]
    bars = [Bar(f"rank {rank['rank']}", category_parts(rank["categories"], f"ranks.{i}.categories"), rank["peak"],
                f"ranks.{i}.peak") for i, rank in enumerate(ranks)]
    rows = [[text(rank["rank"], f"ranks.{i}.rank", ""), size(rank["peak"], units, f"ranks.{i}.peak", 3),
             text(f"{rank['peak_stage']}: step {rank['peak_step']} {rank['peak_phase']}"),
             Cell("yes" if rank["fits"] else "NO", f"ranks.{i}.fits", rank["fits"], "ok" if rank["fits"] else "miss")]
            for i, rank in enumerate(ranks)]
    return section(f"Every rank's peak, measured ({units})", stacked_bars(bars, units),
                   table(["rank", "peak", "at", "fits"], rows))


def _phases_section(data: dict[str, Any], units: str) -> str:
    """The phases of the rank the steady state compares (the one that peaked highest)."""
    compared = data["comparison"].get("steady") or next(iter(data["comparison"].values()), None)
    if compared is None:
        return ""
    index = next(i for i, rank in enumerate(data["ranks"]) if rank["rank"] == compared["rank"])
    phases = data["ranks"][index]["phases"]
    bars = [Bar(f"step {phase['step']} {phase['phase']}", category_parts(phase["categories"], f"ranks.{index}.phases.{j}.categories"),
                phase["peak_bytes"], f"ranks.{index}.phases.{j}.peak_bytes") for j, phase in enumerate(phases)]
    return section(f"Rank {compared['rank']}, phase by phase, measured ({units})", legend(CATEGORY_LABELS),
                   stacked_bars(bars, units))


def _replay_section(data: dict[str, Any], units: str) -> str:
    """Each rank's allocation stream through the caching allocator model: what a GPU would have allocated and
    reserved for it (measure/allocator_replay.py)."""
    rows = []
    for i, rank in enumerate(data["ranks"]):
        replayed = rank.get("allocator_replay") or {}
        if not replayed.get("replayed"):
            continue
        key = f"ranks.{i}.allocator_replay"
        rows.append([text(rank["rank"], f"ranks.{i}.rank", ""),
                     size(replayed["stream_peak_bytes"], units, f"{key}.stream_peak_bytes", 3),
                     size(replayed["allocated_peak_bytes"], units, f"{key}.allocated_peak_bytes", 3),
                     size(replayed["reserved_peak_bytes"], units, f"{key}.reserved_peak_bytes", 3),
                     text(replayed["segments"], f"{key}.segments", "")])
    if not rows:
        return ""
    return section(f"The ranks' allocation streams through the caching allocator model ({units})",
                   table(["rank", "tensors", "allocated", "reserved", "segments at the end"], rows))

"""`zeroplan estimate --format html`: the estimate's JSON document as one page: the peak by category, every
phase as a stacked bar, each rank kind of a mesh, the terms live at the peak, and the three figures on the GPU."""

from __future__ import annotations

from typing import Any

from zeroplan.estimate.serialize import gpu_memory_left_bytes
from zeroplan.report.common import CATEGORY_LABELS, amount
from zeroplan.report.estimate import describe_mesh, estimate_header
from zeroplan.report.html.page import (
    FIGURE_COLORS,
    Bar,
    Cell,
    Part,
    category_parts,
    legend,
    notes,
    page,
    palette,
    paragraph,
    section,
    size,
    stacked_bars,
    table,
    text,
    unit_note,
)


def estimate_page(data: dict[str, Any], units: str = "GiB") -> str:
    """`data` from `estimate_to_dict` (what `--format json` prints) as a self-contained HTML page."""
    lead = estimate_header(data)
    if len(data["ranks"]) > 1 or any(data["mesh"][d] > 1 for d in ("tp", "cp", "pp", "ep", "dp_replicate")):
        lead.append(describe_mesh(data["mesh"]))
    return page(f"zeroplan estimate: {data['model']['name']}", lead, [
        peak_section(data, units),
        phases_section(data, units),
        ranks_section(data, units),
        terms_section(data, units),
        device_section(data, units),
        node_section(data, units),
        step_section(data, units),
        section("Notes", notes(data["notes"])) if data["notes"] else "",
    ])


def peak_section(data: dict[str, Any], units: str, prefix: str = "") -> str:
    per_gpu = data["per_gpu"]
    key = f"{prefix}per_gpu"
    bar = Bar(f"{per_gpu['peak_step']} {per_gpu['peak_phase']}", category_parts(per_gpu, key), per_gpu["peak"],
              f"{key}.peak", "peak")
    limit = data.get("gpu_memory")
    rows = [[text(label), size(per_gpu[category], units, f"{key}.{category}")] for category, label in CATEGORY_LABELS.items()]
    rows.append([text("peak"), size(per_gpu["peak"], units, f"{key}.peak")])
    verdict = ""
    if "fits" in data:
        free = gpu_memory_left_bytes(data)
        verdict = paragraph(f"Fits in {amount(data['gpu_memory'], units)} {units} per GPU: "
                            + (f"yes, {amount(free, units)} {units} to spare" if data["fits"]
                               else f"no, {amount(-free, units)} {units} over"))
    return section(f"Per GPU at the peak ({per_gpu['peak_step']} step, {per_gpu['peak_phase']}; {units})",
                   legend(CATEGORY_LABELS), stacked_bars([bar], units, limit_bytes=limit, limit_label="GPU memory"),
                   table(["category", units], rows), verdict)


def phases_section(data: dict[str, Any], units: str) -> str:
    per_gpu = data["per_gpu"]
    peak = (per_gpu["peak_step"], per_gpu["peak_phase"])
    bars, rows, marked = [], [], []
    for index, phase in enumerate(data["phases"]):
        key = f"phases.{index}"
        is_peak = (phase["step"], phase["phase"]) == peak
        bars.append(Bar(f"{phase['step']} {phase['phase']}", category_parts(phase, key), phase["total"], f"{key}.total",
                        "peak" if is_peak else ""))
        rows.append([text(f"{phase['step']} {phase['phase']}")]
                    + [size(phase[c], units, f"{key}.{c}") for c in CATEGORY_LABELS]
                    + [size(phase["total"], units, f"{key}.total")])
        if is_peak:
            marked.append(index)
    return section(f"Per GPU by phase ({units})", legend(CATEGORY_LABELS), stacked_bars(bars, units),
                   table(["step phase", *CATEGORY_LABELS.values(), "total"], rows, marked), paragraph(unit_note(units)))


def ranks_section(data: dict[str, Any], units: str) -> str:
    """Each rank kind at its peak (a mesh: pipeline stages, the ranks of TP, CP, EP); the worst is the top level."""
    ranks = data["ranks"]
    if len(ranks) < 2 and not any(data["mesh"][d] > 1 for d in ("tp", "cp", "pp", "ep", "dp_replicate")):
        return ""
    worst = data["worst_rank"]
    bars, rows = [], []
    figures = [name for name in ("allocated", "reserved", "device") if name in ranks[0]["per_gpu"]]
    for index, rank in enumerate(ranks):
        key = f"ranks.{index}.per_gpu"
        per_gpu = rank["per_gpu"]
        bars.append(Bar(rank["kind"], category_parts(per_gpu, key), per_gpu["peak"], f"{key}.peak",
                        "worst" if index == worst else ""))
        rows.append([text(rank["kind"], f"ranks.{index}.kind"), text(rank["ranks"], f"ranks.{index}.ranks", ""),
                     text(rank["micro_batches_in_flight"], f"ranks.{index}.micro_batches_in_flight", "")]
                    + [size(per_gpu[c], units, f"{key}.{c}") for c in CATEGORY_LABELS]
                    + [size(per_gpu["peak"], units, f"{key}.peak"), text(f"{per_gpu['peak_step']} {per_gpu['peak_phase']}")]
                    + [size(per_gpu[name], units, f"{key}.{name}") for name in figures])
    headers = ["rank kind", "GPUs", "in flight", *CATEGORY_LABELS.values(), "peak", "at", *figures]
    return section(f"Per GPU at the peak, by rank kind ({units}; worst: {ranks[worst]['kind']})", legend(CATEGORY_LABELS),
                   stacked_bars(bars, units), table(headers, rows, [worst]))


def terms_section(data: dict[str, Any], units: str) -> str:
    """The named terms live at the peak, largest first (`--explain`), each with its source."""
    if not data.get("terms"):
        return ""
    rows = [[text(term["name"], f"terms.{i}.name"), Cell(CATEGORY_LABELS[term["category"]], f"terms.{i}.category",
                                                         term["category"], "text"),
             size(term["bytes"], units, f"terms.{i}.bytes"), text(term["source"], f"terms.{i}.source", "wrap")]
            for i, term in enumerate(data["terms"])]
    bars = [Bar(term["name"], [Part(term["category"], term["bytes"])], term["bytes"]) for term in data["terms"][:12]]
    return section(f"Where the bytes go at the peak ({units}, largest first)", stacked_bars(bars, units),
                   table(["term", "category", units, "source"], rows))


def device_section(data: dict[str, Any], units: str) -> str:
    """What torch.cuda and nvidia-smi would report on the GPU: allocated, reserved, device (issue 22)."""
    device = data.get("device_memory")
    if device is None:
        return ""
    per_gpu = data["per_gpu"]
    outside = sum(term["bytes"] for term in device["outside"])
    bars = [Bar("allocated (max_memory_allocated)", [Part("allocated", per_gpu["allocated"])], per_gpu["allocated"],
                "per_gpu.allocated"),
            Bar("reserved (max_memory_reserved)", [Part("reserved", per_gpu["reserved"])], per_gpu["reserved"],
                "per_gpu.reserved"),
            Bar("device (nvidia-smi)", [Part("reserved", per_gpu["reserved"]), Part("outside", outside)], per_gpu["device"],
                "per_gpu.device")]
    rows = [[text(term["name"], f"device_memory.outside.{i}.name"), size(term["bytes"], units, f"device_memory.outside.{i}.bytes"),
             text(term["source"], f"device_memory.outside.{i}.source", "wrap")] for i, term in enumerate(device["outside"])]
    rows.append([text("cuBLAS workspaces (inside the allocator)"),
                 size(device["cublas_workspaces"], units, "device_memory.cublas_workspaces"), text("")])
    facts = table(["segments at the end", "retries", "out of memory"],
                  [[text(device["segments"], "device_memory.segments", ""),
                    text(device["num_alloc_retries"], "device_memory.num_alloc_retries", ""),
                    text("yes: the figures are what the run would need" if device["ran_out_of_memory"] else "no",
                         None)]])
    return section(f"On the GPU ({units})", legend(("allocated", "reserved", "outside"), FIGURE_COLORS),
                   stacked_bars(bars, units, colors=FIGURE_COLORS, limit_bytes=data.get("gpu_memory"),
                                limit_label="GPU memory"),
                   table(["outside the allocator", units, "source"], rows), facts)


def step_section(data: dict[str, Any], units: str) -> str:
    """With --gpu: the step's time by term (the planner's step-time model), and the smallest changes that would fit."""
    parts = []
    step = data.get("step")
    if step is not None:
        colors = palette(term for term, seconds in step["terms"].items() if seconds > 0)
        bar = Bar(f"{step['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, {step['mfu']:.1%} MFU",
                  [Part(term, seconds, f"step.terms.{term}") for term, seconds in step["terms"].items() if seconds > 0],
                  step["seconds"], "step.seconds")
        parts += [legend(colors, colors), stacked_bars([bar], units, colors=colors, shown=lambda s: f"{s:.3f} s")]
    if data.get("suggestions"):
        parts.append(table(["smallest change that would fit", "options", f"peak ({units})"], [
            [text(s["what"], f"suggestions.{i}.what"), text(s["change"], f"suggestions.{i}.change"),
             size(s["peak"], units, f"suggestions.{i}.peak")] for i, s in enumerate(data["suggestions"])]))
    return section("Step time (seconds) and what would fit", *parts) if parts else ""


def node_section(data: dict[str, Any], units: str) -> str:
    node = data["per_node"]
    return section(f"Per node ({units})", table(["CPU RAM", "pinned", "NVMe"], [[
        size(node["cpu"], units, "per_node.cpu"), size(node["pinned"], units, "per_node.pinned"),
        size(node["nvme"], units, "per_node.nvme")]]))


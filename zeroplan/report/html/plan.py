"""`zeroplan plan --format html`: the ranking with why each configuration (or mesh) ranks where it does, its
memory against the budget and its step's cost by term; the smallest changes that would fit when nothing does."""

from __future__ import annotations

from typing import Any

from zeroplan.report.common import CATEGORY_LABELS, amount
from zeroplan.report.html.page import (
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
)


def plan_page(data: dict[str, Any], units: str = "GiB") -> str:
    """`data` from `plan_to_dict` or `mesh_plan_to_dict` (what `zeroplan plan [--mesh] --format json` prints)."""
    return (_mesh_page if "gpus" in data and "headroom" not in data else _plan_page)(data, units)


def _seconds(value: float) -> str:
    return f"{value:.3f} s"


def _memory_section(bars: list[Bar], budget: int, units: str, what: str) -> str:
    return section(f"Per GPU at the peak{what} ({units})", legend(CATEGORY_LABELS),
                   stacked_bars(bars, units, limit_bytes=budget, limit_label="budget"))


def _cost_section(rows: list[tuple[str, dict[str, float], str, float, str]]) -> str:
    """(label, seconds by term, key of the terms, total, key of the total) per plan, as stacked bars of a step."""
    colors = palette(term for _, terms, _, _, _ in rows for term, seconds in terms.items() if seconds > 0)
    bars = [Bar(label, [Part(term, seconds, f"{key}.{term}") for term, seconds in terms.items() if seconds > 0],
                total, total_key) for label, terms, key, total, total_key in rows]
    return section("Estimated step time by term (seconds)", legend(colors, colors),
                   stacked_bars(bars, "GiB", colors=colors, shown=_seconds))


def _plan_page(data: dict[str, Any], units: str) -> str:
    top = data["top"]
    lead = [f"{amount(data['gpu_memory'], units)} {units} per GPU, budget {amount(data['budget'], units)} {units} after "
            f"{data['headroom']:.0%} headroom; searched {data['evaluated']:,} configurations ({data['estimate_calls']:,} "
            f"memory-model evaluations), {data['fitting']:,} fit"]
    rows = []
    for i, plan in enumerate(top):
        key = f"top.{i}"
        rows.append([text(plan["rank"], f"{key}.rank", ""), text(plan["config"], f"{key}.config"),
                     text(plan["gpus"], f"{key}.gpus", ""),
                     text(f"{plan['micro_batch']} x {plan['grad_accum']}"),
                     size(plan["per_gpu"]["peak"], units, f"{key}.per_gpu.peak"),
                     size(plan["per_node"]["cpu"], units, f"{key}.per_node.cpu"),
                     Cell(f"{plan['step_seconds']['total']:.3f}", f"{key}.step_seconds.total", plan["step_seconds"]["total"]),
                     Cell(f"{plan['gpu_seconds_per_million_tokens']:,.1f}", f"{key}.gpu_seconds_per_million_tokens",
                          plan["gpu_seconds_per_million_tokens"]),
                     text(plan["reason"], f"{key}.reason", "wrap")])
    label = [f"#{plan['rank']} {plan['config']}, {plan['gpus']} GPUs, {plan['micro_batch']} x {plan['grad_accum']}"
             for plan in top]
    sections = []
    if top:
        headers = ["#", "config", "GPUs", "micro x accum", f"peak ({units})", f"CPU/node ({units})", "step (s)",
                   "GPU s per M tokens", "why it ranks here"]
        sections.append(section("Ranking", table(headers, rows)))
        sections.append(_memory_section([Bar(label[i], category_parts(plan["per_gpu"], f"top.{i}.per_gpu"),
                                             plan["per_gpu"]["peak"], f"top.{i}.per_gpu.peak")
                                         for i, plan in enumerate(top)], data["budget"], units, ""))
        sections.append(_cost_section([(label[i], {k: v for k, v in plan["step_seconds"].items() if k != "total"},
                                        f"top.{i}.step_seconds", plan["step_seconds"]["total"], f"top.{i}.step_seconds.total")
                                       for i, plan in enumerate(top)]))
        largest = data["largest_micro_batch"]
        if largest is not None:
            sections.append(paragraph(f"largest micro-batch that fits: {largest['micro_batch']} ({largest['config']} on "
                                      f"{largest['gpus']} GPUs, peak {amount(largest['per_gpu']['peak'], units)} {units}, "
                                      f"rank {largest['rank']})"))
    else:
        sections.append(section("Nothing fits. Smallest changes that would", notes(data["suggestions"])))
    assumptions = [[text(name), text(value, f"assumptions.{name}", "")] for name, value in data["assumptions"].items()]
    sections.append(section("Assumptions (override them with options)", table(["assumption", "value"], assumptions)))
    if data["notes"]:
        sections.append(section("Notes", notes(data["notes"])))
    return page(f"zeroplan plan: {data['model']}", lead, sections)


def mesh_label(mesh: dict[str, Any]) -> str:
    """A mesh in one line, as the mesh plan's table writes it (report/mesh.py)."""
    return (f"tp {mesh['tp']} cp {mesh['cp']} pp {mesh['pp']}" + (f" {mesh['pp_schedule']}" if mesh["pp"] > 1 else "")
            + f" dp {mesh['dp_shard']}" + (f" x {mesh['dp_replicate']} replicas" if mesh["dp_replicate"] > 1 else "")
            + (f" ep {mesh['ep']}" if mesh["ep"] > 1 else ""))


def _mesh_page(data: dict[str, Any], units: str) -> str:
    top = data["top"]
    lead = [f"{data['gpus']} GPUs: {data['fitting']:,} mesh and checkpointing choices fit in "
            f"{amount(data['budget'], units)} {units} per GPU ({data['evaluated']:,} fit checks)"]
    if data.get("cost_bounded"):
        lead.append(f"{data['cost_bounded']:,} more could not rank in the top {len(top)} at any micro-batch (a bound on "
                    "their cost) and were not checked")
    rows, labels = [], []
    for i, plan in enumerate(top):
        key = f"top.{i}"
        labels.append(f"#{plan['rank']} {mesh_label(plan['mesh'])}")
        rows.append([text(plan["rank"], f"{key}.rank", ""), text(mesh_label(plan["mesh"])),
                     text(f"ZeRO-{plan['zero_stage']}"), text(plan["checkpointing"], f"{key}.checkpointing"),
                     text(plan["micro_batch"], f"{key}.micro_batch", ""), text(plan["grad_accum"], f"{key}.grad_accum", ""),
                     text(plan["worst_rank"], f"{key}.worst_rank"),
                     size(plan["per_gpu"]["peak"], units, f"{key}.per_gpu.peak"),
                     Cell(f"{plan['tokens_per_s_per_gpu']:,.0f}", f"{key}.tokens_per_s_per_gpu", plan["tokens_per_s_per_gpu"]),
                     text(plan["reason"], f"{key}.reason", "wrap")])
    sections = []
    if top:
        headers = ["#", "mesh", "stage", "ckpt", "micro", "accum", "worst rank", f"worst peak ({units})", "tokens/s/GPU",
                   "why it ranks here"]
        sections += [
            section("Ranking", table(headers, rows)),
            _memory_section([Bar(labels[i], category_parts(plan["per_gpu"], f"top.{i}.per_gpu"), plan["per_gpu"]["peak"],
                                 f"top.{i}.per_gpu.peak") for i, plan in enumerate(top)], data["budget"], units,
                            " (worst rank)"),
            _cost_section([(labels[i], plan["cost_terms_s"], f"top.{i}.cost_terms_s", plan["step_s"], f"top.{i}.step_s")
                           for i, plan in enumerate(top)]),
        ]
    else:
        sections.append(paragraph("none fits"))
    return page(f"zeroplan plan --mesh: {data['model']}", lead, sections)

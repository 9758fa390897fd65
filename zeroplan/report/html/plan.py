"""`zeroplan plan --format html`: the ranking with why each configuration (or mesh) ranks where it does, its
memory against the budget and its step's time by term; the smallest changes that would fit when nothing does."""

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
from zeroplan.report.plan import config_cell


def plan_page(data: dict[str, Any], units: str = "GiB") -> str:
    """`data` from `plan_to_dict` (what `zeroplan plan [--mesh] --format json` prints) as one page."""
    top = data["top"]
    lead = [f"{amount(data['gpu_memory'], units)} {units} per GPU, budget {amount(data['budget'], units)} {units} after "
            f"{data['headroom']:.0%} headroom; searched {data['evaluated']:,} configurations ({data['estimate_calls']:,} "
            f"memory-model evaluations), {data['fitting']:,} fit"]
    if data["cost_bounded"]:
        lead.append(f"{data['cost_bounded']:,} more choices could not rank in the top {len(top) or 1} at any micro-batch "
                    "(a bound on their cost) and were not checked")
    labels = [f"#{plan['rank']} {config_cell(plan)}, {plan['gpus']} GPUs, {plan['micro_batch']} x {plan['grad_accum']}"
              for plan in top]
    sections = []
    if top:
        sections += [section("Ranking", _ranking(data, units)),
                     section(f"Per GPU at the peak ({units}; a mesh's worst rank)", legend(CATEGORY_LABELS),
                             stacked_bars([Bar(labels[i], category_parts(plan["per_gpu"], f"top.{i}.per_gpu"),
                                               plan["per_gpu"]["peak"], f"top.{i}.per_gpu.peak")
                                           for i, plan in enumerate(top)], units, limit_bytes=data["budget"],
                                          limit_label="budget")),
                     _step_section(top, labels)]
        largest = data["largest_micro_batch"]
        if largest is not None:
            sections.append(paragraph(f"largest micro-batch that fits: {largest['micro_batch']} ({config_cell(largest)} "
                                      f"on {largest['gpus']} GPUs, peak {amount(largest['per_gpu']['peak'], units)} "
                                      f"{units}, rank {largest['rank']})"))
    else:
        sections.append(section("Nothing fits. Smallest changes that would", notes(data["suggestions"])))
    assumptions = [[text(name.replace("_", " ")), Cell(_number(value), f"assumptions.{name}", value,
                                                        "wrap" if isinstance(value, str) else "")]
                   for name, value in data["assumptions"].items()]
    sections.append(section("Assumptions (override them with options)", table(["assumption", "value"], assumptions)))
    if data["notes"]:
        sections.append(section("Notes", notes(data["notes"])))
    return page(f"zeroplan plan: {data['model']}", lead, sections)


def _number(value: Any) -> str:
    """An assumption as a reader takes it in: whole numbers with separators, yes/no, text as it is."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1000:
        return f"{int(value):,}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _ranking(data: dict[str, Any], units: str) -> str:
    rows = []
    for i, plan in enumerate(data["top"]):
        key, step = f"top.{i}", plan["step"]
        rows.append([text(plan["rank"], f"{key}.rank", ""), text(config_cell(plan)), text(plan["gpus"], f"{key}.gpus", ""),
                     text(f"{plan['micro_batch']} x {plan['grad_accum']}", None, ""),
                     size(plan["per_gpu"]["peak"], units, f"{key}.per_gpu.peak"),
                     size(plan["per_node"]["cpu"], units, f"{key}.per_node.cpu"),
                     Cell(f"{step['seconds']:.3f}", f"{key}.step.seconds", step["seconds"]),
                     Cell(f"{step['tokens_per_s_per_gpu']:,.0f}", f"{key}.step.tokens_per_s_per_gpu",
                          step["tokens_per_s_per_gpu"]),
                     Cell(f"{step['mfu']:.0%}", f"{key}.step.mfu", step["mfu"]),
                     text(plan["reason"], f"{key}.reason", "wrap")])
    headers = ["#", "config", "GPUs", "micro x accum", f"peak ({units})", f"CPU/node ({units})", "step (s)",
               "tokens/s/GPU", "MFU", "why it ranks here"]
    return table(headers, rows)


def _step_section(top: list[dict[str, Any]], labels: list[str]) -> str:
    """Each plan's step time as a stacked bar of its terms (seconds; they sum to the step)."""
    colors = palette(term for plan in top for term, seconds in plan["step"]["terms"].items() if seconds > 0)
    bars = [Bar(labels[i], [Part(term, seconds, f"top.{i}.step.terms.{term}")
                            for term, seconds in plan["step"]["terms"].items() if seconds > 0],
                plan["step"]["seconds"], f"top.{i}.step.seconds") for i, plan in enumerate(top)]
    return section("Estimated step time by term (seconds)", legend(colors, colors),
                   stacked_bars(bars, "GiB", colors=colors, shown=lambda seconds: f"{seconds:.3f} s"))

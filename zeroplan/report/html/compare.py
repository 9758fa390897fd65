"""`zeroplan compare --format html`: the grid of configurations as stacked bars on one scale, with the GPU's
budget drawn across them, and the table of `zeroplan compare`."""

from __future__ import annotations

from typing import Any

from zeroplan.report.common import CATEGORY_LABELS, amount
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
    unit_note,
)


def _label(row: dict[str, Any]) -> str:
    offload = "" if row["offload"] == "none" else f", offload {row['offload']}"
    return f"{row['config']}, {row['gpus']} GPUs{offload}"


def compare_page(data: dict[str, Any], units: str = "GiB") -> str:
    """`data` from `comparison_to_dict` (what `zeroplan compare --format json` prints) as one page."""
    rows = data["rows"]
    bars = [Bar(_label(row), category_parts(row["per_gpu"], f"rows.{i}.per_gpu"), row["per_gpu"]["peak"],
                f"rows.{i}.per_gpu.peak") for i, row in enumerate(rows)]
    cells = []
    for i, row in enumerate(rows):
        per_gpu, key = row["per_gpu"], f"rows.{i}"
        saving = row["saving_vs_stage0_percent"]
        fits = row["fits"]
        cells.append([text(row["config"], f"{key}.config"), text(row["gpus"], f"{key}.gpus", ""),
                      text(row["offload"], f"{key}.offload")]
                     + [size(per_gpu[c], units, f"{key}.per_gpu.{c}") for c in CATEGORY_LABELS]
                     + [size(per_gpu["peak"], units, f"{key}.per_gpu.peak"),
                        text(f"{per_gpu['peak_step']} {per_gpu['peak_phase']}"),
                        size(row["per_node"]["cpu"], units, f"{key}.per_node.cpu"),
                        size(row["per_node"]["nvme"], units, f"{key}.per_node.nvme"),
                        Cell("" if saving is None else f"{saving:.1f}%", f"{key}.saving_vs_stage0_percent", saving),
                        Cell("" if fits is None else ("yes" if fits else "NO"), f"{key}.fits", fits,
                             "" if fits is None else ("ok" if fits else "miss"))])
    budget = data["budget"]
    lead = [f"per-GPU memory at the peak of {len(rows)} configurations; saving = peak below the ZeRO-0 baseline on the "
            "same GPU count"]
    if budget is not None:
        lead.append(f"fits = peak <= {amount(budget, units)} {units} (the GPU's {amount(data['gpu_memory'], units)} "
                    f"{units} less headroom)")
    headers = ["config", "GPUs", "offload", *CATEGORY_LABELS.values(), "peak", "peak phase", "CPU/node", "NVMe/node",
               "saving", "fits"]
    return page(f"zeroplan compare: {data['model']}", lead, [
        section(f"Per GPU at the peak ({units})", legend(CATEGORY_LABELS),
                stacked_bars(bars, units, limit_bytes=budget, limit_label="budget"), paragraph(unit_note(units))),
        section(f"Configurations ({units})", table(headers, cells)),
        section("Skipped", notes(data["skipped"])) if data["skipped"] else "",
    ])

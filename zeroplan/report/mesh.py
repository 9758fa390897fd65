"""Formatting a mesh estimate (`zeroplan.estimate.serialize_mesh`): the mesh, one row per rank kind,
then the worst rank as a single-rank estimate is shown."""

from __future__ import annotations

from typing import Any

from zeroplan.report.common import CATEGORY_LABELS, amount, table
from zeroplan.report.estimate import render_estimate


def describe_mesh(mesh: dict[str, Any]) -> str:
    """One line: every degree, the schedule, and the data-parallel sharding left."""
    parts = [f"tp {mesh['tp']}" + (" (sequence parallel)" if mesh["tp"] > 1 and mesh["sequence_parallel"] else ""),
             f"cp {mesh['cp']}",
             f"pp {mesh['pp']}" + (f" ({mesh['pp_schedule']}" + (f", {mesh['pp_virtual_stages']} stages per rank"
                                    if mesh["pp_virtual_stages"] > 1 else "") + ")" if mesh["pp"] > 1 else ""),
             f"dp_replicate {mesh['dp_replicate']}", f"dp_shard {mesh['dp_shard']}"]
    if mesh["ep"] > 1:
        parts.append(f"ep {mesh['ep']} (experts sharded over {mesh['expert_fsdp_degree']})")
    return f"Mesh: {' x '.join(parts)}; parameters sharded over dp_shard x cp = {mesh['fsdp_degree']} ranks"


def _ranks_table(data: dict[str, Any], units: str, markdown: bool) -> str:
    rows = []
    for index, rank in enumerate(data["ranks"]):
        per_gpu = rank["per_gpu"]
        rows.append([rank["kind"], rank["ranks"], rank["micro_batches_in_flight"]]
                    + [amount(per_gpu[key], units) for key in CATEGORY_LABELS]
                    + [amount(per_gpu["peak"], units), f"{per_gpu['peak_step']} {per_gpu['peak_phase']}",
                       "<- worst" if index == data["worst_rank"] else ""])
    return table(rows, ["rank kind", "GPUs", "in flight", *CATEGORY_LABELS.values(), "peak", "at", ""], markdown)


def render_mesh_estimate(data: dict[str, Any], output_format: str = "table", units: str = "GiB") -> str:
    """`data` from `mesh_estimate_to_dict`; json and csv as `render_estimate` (csv: the worst rank's phases)."""
    if output_format in ("json", "csv"):
        return render_estimate(data, output_format, units)
    markdown = output_format == "markdown"
    worst = data["ranks"][data["worst_rank"]]["kind"]
    heading = "### " if markdown else ""
    out = [describe_mesh(data["mesh"]), "", f"{heading}Per GPU at the peak, by rank kind ({units})",
           _ranks_table(data, units, markdown), "", f"{heading}Worst rank: {worst}", ""]
    return "\n".join(out) + render_estimate(data, output_format, units)

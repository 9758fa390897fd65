"""Formatting a mesh estimate (`zeroplan.estimate.serialize_mesh`): the mesh, one row per rank kind,
then the worst rank as a single-rank estimate is shown."""

from __future__ import annotations

from typing import Any

from zeroplan.report.common import CATEGORY_LABELS, amount, table
from zeroplan.report.estimate import estimate_header, render_estimate


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
                       "<-" if index == data["worst_rank"] else ""])
    return table(rows, ["rank kind", "GPUs", "in flight", *CATEGORY_LABELS.values(), "peak", "at", "worst"], markdown,
                 colalign=("left",) + ("right",) * (len(CATEGORY_LABELS) + 4) + ("left",))


def render_mesh_estimate(data: dict[str, Any], output_format: str = "table", units: str = "GiB") -> str:
    """`data` from `mesh_estimate_to_dict`; json and csv as `render_estimate` (csv: the worst rank's phases)."""
    if output_format in ("json", "csv"):
        return render_estimate(data, output_format, units)
    markdown = output_format == "markdown"
    worst = data["ranks"][data["worst_rank"]]["kind"]
    heading = "### " if markdown else ""
    out = [*estimate_header(data, markdown), "", describe_mesh(data["mesh"]), "",
           f"{heading}Per GPU at the peak, by rank kind ({units})", _ranks_table(data, units, markdown), "",
           f"{heading}Worst rank: {worst}", ""]
    return "\n".join(out) + render_estimate(data, output_format, units, header=False)


def render_mesh_plan(data: dict[str, Any], output_format: str = "table", units: str = "GiB") -> str:
    """`data` from `zeroplan.plan.mesh.mesh_plan_to_dict`: json, or one row per mesh with why it ranks there."""
    if output_format == "json":
        import json

        return json.dumps(data, indent=2) + "\n"
    markdown = output_format == "markdown"
    rows = [[row["rank"], f"tp {row['mesh']['tp']} cp {row['mesh']['cp']} pp {row['mesh']['pp']}"
             + (f" {row['mesh']['pp_schedule']}" if row["mesh"]["pp"] > 1 else "") + f" dp {row['mesh']['dp_shard']}"
             + (f" x {row['mesh']['dp_replicate']} replicas" if row["mesh"]["dp_replicate"] > 1 else "")
             + (f" ep {row['mesh']['ep']}" if row["mesh"]["ep"] > 1 else ""),
             f"ZeRO-{row['zero_stage']}", row["checkpointing"], row["micro_batch"], row["grad_accum"],
             amount(row["per_gpu"]["peak"], units), f"{row['tokens_per_s_per_gpu']:,.0f}", row["reason"]]
            for row in data["top"]]
    # fitting and cost_bounded count mesh and checkpointing choices; evaluated counts fit checks (one per
    # micro-batch the search tried of a choice)
    head = (f"{data['model']} on {data['gpus']} GPUs: {data['fitting']:,} mesh and checkpointing choices fit in "
            f"{amount(data['budget'], units)} {units} per GPU ({data['evaluated']:,} fit checks)")
    if data.get("cost_bounded"):
        head += (f"; {data['cost_bounded']:,} more could not rank in the top {len(data['top'])} at any micro-batch "
                 "(a bound on their cost) and were not checked")
    if not rows:
        return head + "; none fits\n"
    headers = ["#", "mesh", "stage", "ckpt", "micro", "accum", f"worst peak {units}", "tokens/s/GPU", "why it ranks here"]
    # the reason reads as text, from the left, broken into lines that a terminal shows whole
    return head + "\n\n" + table(rows, headers, markdown, colalign=("right", "left", "left", "left") + ("right",) * 4
                                   + ("left",), wrap=[None] * 8 + [_WHY_WIDTH]) + "\n"


_WHY_WIDTH = 80
"""Characters per line of the mesh plan's "why it ranks here" column."""

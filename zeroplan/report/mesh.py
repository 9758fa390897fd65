"""Formatting a mesh plan: one row per mesh with why it ranks there (a mesh estimate is rendered by
report/estimate.py, as every estimate is)."""

from __future__ import annotations

from typing import Any

from zeroplan.report.common import CATEGORY_LABELS, amount, table


def render_mesh_plan(data: dict[str, Any], output_format: str = "table", units: str = "GiB") -> str:
    """`data` from `zeroplan.plan.mesh.mesh_plan_to_dict`: json, or one row per mesh with why it ranks there."""
    if output_format == "json":
        import json

        return json.dumps(data, indent=2) + "\n"
    if output_format == "html":
        from zeroplan.report.html.plan import plan_page

        return plan_page(data, units)
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

"""Formatting a `Plan` (zeroplan.plan.search): table, JSON, CSV or Markdown. No arithmetic beyond units."""

from __future__ import annotations

import csv
import io
import json
from typing import TYPE_CHECKING

from zeroplan.errors import SpecError
from zeroplan.estimate.serialize import per_gpu_to_dict, per_node_to_dict
from zeroplan.report.common import FORMATS, REPORT_FORMATS, amount, table

if TYPE_CHECKING:
    from zeroplan.plan.search import Plan, RankedConfig

_GB = 10**9


def _config_dict(config: RankedConfig) -> dict:
    return {
        "rank": config.rank,
        "config": config.choice.label(),
        "zero_stage": config.choice.zero_stage,
        "offload_optimizer": config.choice.offload_optimizer.value,
        "offload_params": config.choice.offload_params.value,
        "checkpointing": config.choice.checkpointing.value,
        "gpus": config.choice.gpus,
        "micro_batch": config.micro_batch,
        "grad_accum": config.grad_accum,
        "per_gpu": per_gpu_to_dict(config.estimate),  # the shapes of `zeroplan estimate --format json`
        "per_node": per_node_to_dict(config.estimate.per_node),
        "step_seconds": {**config.cost.terms(), "total": config.cost.step_s},
        "tokens_per_step_per_gpu": config.cost.tokens,
        "gpu_seconds_per_million_tokens": config.cost.gpu_seconds_per_token * 1e6,
        "reason": config.reason,
    }


def plan_to_dict(plan: Plan) -> dict:
    """The plan as plain data: bytes as ints, seconds as floats."""
    return {
        "model": plan.model_name,
        "gpu_memory": plan.limits.gpu_memory_bytes,
        "headroom": plan.limits.headroom,
        "budget": plan.limits.budget_bytes,
        "cpu_memory_per_node": plan.limits.cpu_memory_bytes,
        "nvme_per_node": plan.limits.nvme_bytes,
        "evaluated": plan.evaluated,
        "fitting": plan.fitting,
        "estimate_calls": plan.estimate_calls,
        "top": [_config_dict(config) for config in plan.top],
        "largest_micro_batch": None if plan.largest_micro_batch is None else _config_dict(plan.largest_micro_batch),
        "suggestions": list(plan.suggestions),
        "assumptions": plan.assumptions.model_dump(),
        "notes": list(plan.notes),
    }


def _assumption_lines(plan: Plan) -> list[str]:
    a = plan.assumptions
    return [
        f"assumptions (override with options): GPU {a.gpu_flops_per_s / 1e12:,.0f} TFLOP/s dense bf16 at up to "
        f"{a.max_efficiency:.0%} efficiency, half of that at {a.half_efficiency_tokens} tokens per micro-batch;",
        f"  GPU-GPU {a.intra_node_bytes_per_s / _GB:,.0f} GB/s in a node, {a.inter_node_bytes_per_s / _GB:,.0f} GB/s "
        f"between nodes; PCIe {a.pcie_bytes_per_s / _GB:,.0f} GB/s; HBM {a.hbm_bytes_per_s / _GB:,.0f} GB/s; CPU memory "
        f"{a.cpu_memory_bytes_per_s / _GB:,.0f} GB/s and NVMe {a.nvme_bytes_per_s / _GB:,.1f} GB/s per node "
        "(one direction; no overlap of communication with compute)",
        f"  GPU figures: {a.source}",
    ]


def render_plan(plan: Plan, fmt: str = "table", units: str = "GiB") -> str:
    if fmt == "json":
        return json.dumps(plan_to_dict(plan), indent=2) + "\n"
    if fmt == "html":
        from zeroplan.report.html.plan import plan_page

        return plan_page(plan_to_dict(plan), units)
    configs = list(plan.top)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(["rank", "config", "gpus", "micro_batch", "grad_accum", "peak_bytes", "cpu_per_node_bytes",
                         "nvme_per_node_bytes", "step_seconds", "gpu_seconds_per_million_tokens", "reason"])
        for config in configs:
            data = _config_dict(config)
            writer.writerow([data["rank"], data["config"], data["gpus"], data["micro_batch"], data["grad_accum"],
                             data["per_gpu"]["peak"], data["per_node"]["cpu"], data["per_node"]["nvme"],
                             f"{config.cost.step_s:.6g}", f"{data['gpu_seconds_per_million_tokens']:.6g}", data["reason"]])
        return out.getvalue()
    if fmt not in FORMATS:
        raise SpecError(f"--format: unknown format {fmt!r}; use {', '.join(REPORT_FORMATS)}")
    limits = plan.limits
    lines = [
        f"{plan.model_name}: {amount(limits.gpu_memory_bytes, units)} {units} per GPU, budget {amount(limits.budget_bytes, units)} {units} "
        f"after {limits.headroom:.0%} headroom; searched {plan.evaluated:,} configurations "
        f"({plan.estimate_calls:,} memory-model evaluations), {plan.fitting:,} fit",
    ]
    if configs:
        rows = []
        for config in configs:
            cost = config.cost
            rows.append([
                str(config.rank), config.choice.label(), str(config.choice.gpus), f"{config.micro_batch} x {config.grad_accum}",
                amount(config.estimate.peak_bytes, units), amount(config.estimate.per_node.cpu_bytes, units), f"{cost.step_s:.3f}",
                f"{cost.tokens_per_s:,.0f}", config.reason,
            ])
        headers = ["#", "config", "GPUs", "micro x accum", f"peak ({units})", f"CPU/node ({units})", "step (s)",
                   "tokens/s/GPU", "why it ranks here"]
        lines.append(table(rows, headers, markdown=fmt == "markdown",
                           colalign=("right", "left", "right", "right", "right", "right", "right", "right", "left")))
        largest = plan.largest_micro_batch
        if largest is not None:
            lines.append(f"largest micro-batch that fits: {largest.micro_batch} ({largest.choice.label()} on "
                         f"{largest.choice.gpus} GPUs, peak {amount(largest.estimate.peak_bytes, units)} {units}, rank {largest.rank})")
    else:
        lines.append("nothing fits. Smallest changes that would:")
        lines.extend(f"  - {suggestion}" for suggestion in plan.suggestions)
    lines.extend(_assumption_lines(plan))
    lines.extend(f"note: {note}" for note in plan.notes)
    return "\n".join(lines) + "\n"

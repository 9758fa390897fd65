"""Formatting a plan (`zeroplan.plan.serialize.plan_to_dict`, with or without a mesh search) and a configuration's
step time and suggestions: table, JSON, CSV or Markdown. No arithmetic beyond units and shares."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from zeroplan.errors import SpecError
from zeroplan.report.common import FORMATS, amount, table

_GB = 10**9


def step_line(data: dict[str, Any]) -> str:
    """One line saying where the step goes: `data` from `step_to_dict`."""
    terms = sorted(((name, value) for name, value in data["terms"].items() if value > 0), key=lambda item: -item[1])
    parts = ", ".join(f"{name} {value / data['seconds']:.0%}" for name, value in terms)
    return (f"Step: {data['seconds']:.3f} s, {data['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, "
            f"{data['mfu']:.1%} MFU; {parts}")


def suggestion_lines(data: list[dict[str, Any]], units: str) -> list[str]:
    if not data:
        return ["Nothing tried fits (a smaller micro-batch, checkpointing, a higher stage, offload, up to 65,536 GPUs)."]
    return ["Smallest changes that would fit:"] + [
        f"  - {s['what']} ({s['change']}): peak {amount(s['peak'], units)} {units}" for s in data]


def _assumption_lines(a: dict[str, Any]) -> list[str]:
    knobs = [name for name, on in (("torch.compile", a["compile"]), ("float8", a["float8"]), ("async TP", a["async_tp"]))
             if on]
    calibrated = f", calibrated x{a['calibration']:.3g}" if a["calibration"] != 1 else ""
    return [
        f"assumptions (override with options): GPU {a['gpu_flops_per_s'] / 1e12:,.0f} TFLOP/s dense bf16, a step's "
        f"compute at {a['step_efficiency']:.1%} MFU{calibrated}, FlashAttention at {a['attention_utilization']:.0%} of "
        f"peak, matmuls at up to {a['matmul_flops_per_s'] / 1e12:,.0f} TFLOP/s (the memory's pace when smaller)"
        + (f"; {', '.join(knobs)}" if knobs else "") + ";",
        f"  GPU-GPU {a['intra_node_bytes_per_s'] / _GB:,.0f} GB/s in a node, {a['inter_node_bytes_per_s'] / _GB:,.0f} "
        f"GB/s between nodes; PCIe {a['pcie_bytes_per_s'] / _GB:,.0f} GB/s; HBM {a['hbm_bytes_per_s'] / _GB:,.0f} GB/s; "
        f"CPU memory {a['cpu_memory_bytes_per_s'] / _GB:,.0f} GB/s and NVMe {a['nvme_bytes_per_s'] / _GB:,.1f} GB/s per "
        "node (one direction; collectives overlap compute where the engine prefetches: docs/throughput.md)",
        f"  GPU figures: {a['source']}",
    ]


def config_cell(config: dict) -> str:
    """A configuration in one cell: its label, and its mesh where it has one (tables and the HTML page)."""
    if config["mesh"] is None:
        return config["config"]
    mesh = config["mesh"]
    parts = [f"{name} {mesh[name]}" for name in ("tp", "cp") if mesh[name] > 1]
    if mesh["pp"] > 1:
        parts.append(f"pp {mesh['pp']} {mesh['pp_schedule']}")
    parts.append(f"dp {mesh['dp_shard']}" + (f" x {mesh['dp_replicate']}" if mesh["dp_replicate"] > 1 else ""))
    if mesh["ep"] > 1:
        parts.append(f"ep {mesh['ep']}")
    return f"{config['config']}, {' '.join(parts)}"


WHY_WIDTH = 80  # the reason column's widest line: a plan reads in a terminal, not a page 300 characters wide


def render_plan(data: dict[str, Any], fmt: str = "table", units: str = "GiB") -> str:
    """`data` from `zeroplan.plan.serialize.plan_to_dict`."""
    if fmt == "json":
        return json.dumps(data, indent=2) + "\n"
    configs = data["top"]
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(["rank", "config", "gpus", "micro_batch", "grad_accum", "peak_bytes", "cpu_per_node_bytes",
                         "nvme_per_node_bytes", "step_seconds", "gpu_seconds_per_million_tokens", "reason"])
        for config in configs:
            writer.writerow([config["rank"], config_cell(config), config["gpus"], config["micro_batch"],
                             config["grad_accum"], config["per_gpu"]["peak"], config["per_node"]["cpu"],
                             config["per_node"]["nvme"], f"{config['step']['seconds']:.6g}",
                             f"{config['gpu_seconds_per_million_tokens']:.6g}", config["reason"]])
        return out.getvalue()
    if fmt not in FORMATS:
        raise SpecError(f"--format: unknown format {fmt!r}; use {', '.join(FORMATS)}")
    head = (f"{data['model']}: {amount(data['gpu_memory'], units)} {units} per GPU, budget "
            f"{amount(data['budget'], units)} {units} after {data['headroom']:.0%} headroom (fits = peak <= budget: the "
            "tensors and the memory outside the allocator, not the device figure; zeroplan estimate gives that); searched "
            f"{data['evaluated']:,} configurations ({data['estimate_calls']:,} memory-model evaluations), "
            f"{data['fitting']:,} fit")
    if data["cost_bounded"]:
        head += (f"; {data['cost_bounded']:,} more choices could not rank in the top {len(configs) or 1} at any "
                 "micro-batch (a bound on their cost) and were not checked")
    lines = [head]
    if configs:
        rows = [[str(c["rank"]), config_cell(c), str(c["gpus"]), f"{c['micro_batch']} x {c['grad_accum']}",
                 amount(c["per_gpu"]["peak"], units), amount(c["per_node"]["cpu"], units), f"{c['step']['seconds']:.3f}",
                 f"{c['step']['tokens_per_s_per_gpu']:,.0f}", f"{c['step']['mfu']:.0%}", c["reason"]] for c in configs]
        headers = ["#", "config", "GPUs", "micro x accum", f"peak ({units})", f"CPU/node ({units})", "step (s)",
                   "tokens/s/GPU", "MFU", "why it ranks here"]
        lines.append(table(rows, headers, markdown=fmt == "markdown",
                           colalign=("right", "left", "right", "right", "right", "right", "right", "right", "right",
                                     "left"), wrap=[None] * 9 + [WHY_WIDTH]))
        largest = data["largest_micro_batch"]
        if largest is not None:
            lines.append(f"largest micro-batch that fits: {largest['micro_batch']} ({config_cell(largest)} on "
                         f"{largest['gpus']} GPUs, peak {amount(largest['per_gpu']['peak'], units)} {units}, rank "
                         f"{largest['rank']})")
    else:
        lines.append("nothing fits. Smallest changes that would:")
        lines.extend(f"  - {suggestion}" for suggestion in data["suggestions"])
    lines.extend(_assumption_lines(data["assumptions"]))
    lines.extend(f"note: {note}" for note in data["notes"])
    return "\n".join(lines) + "\n"

"""Formatting only: results as a table (tabulate), JSON, CSV or Markdown.

Everything here renders the plain data of `zeroplan.estimate.serialize` (bytes as ints), so all
formats agree with the JSON contract. Bytes become GiB (2^30, the default), GB, MiB or MB only
here, and every figure is labelled with the unit it was divided by.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Sequence
from typing import Any

from zeroplan.spec.units import bytes_in_unit

FORMATS = ("table", "json", "csv", "markdown")

CATEGORY_LABELS = {
    "params": "params",
    "grads": "grads",
    "optimizer_states": "optimizer states",
    "activations": "activations",
    "buffers": "buffers",
    "temporaries": "temporaries",
    "overhead": "overhead",
}
"""Category keys of `per_gpu` and `phases[]`, in report order, with their table labels."""

_SHORT_LABELS = CATEGORY_LABELS | {"optimizer_states": "opt states", "temporaries": "temps"}
"""Labels of the (wide) per-phase table."""

_PRECISION_LABELS = {"fp32": "fp32", "fp16": "fp16 mixed", "bf16": "bf16 mixed", "pure-bf16": "pure bf16"}


def _amount(size_bytes: int, units: str) -> str:
    return f"{bytes_in_unit(size_bytes, units):,.2f}"


def _tabulate(rows: Sequence[Sequence[Any]], headers: Sequence[str], markdown: bool, left: int = 1) -> str:
    """A table whose first `left` columns are text (left-aligned) and the rest figures."""
    from tabulate import tabulate  # imported when a table is drawn, not for json/csv

    return tabulate(
        rows,
        headers=headers,
        tablefmt="github" if markdown else "simple",
        disable_numparse=True,
        colalign=("left",) * left + ("right",) * (len(headers) - left),
    )


def _describe_config(data: dict[str, Any]) -> str:
    """One line: engine, stage, world, precision, optimizer, batch, offload, device."""
    config = data["config"]
    nodes = config["gpus"] // config["gpus_per_node"]
    parts = [
        f"{data['engine']} ZeRO-{config['zero_stage']}",
        f"{config['gpus']} GPU{'s' if config['gpus'] > 1 else ''} ({nodes} node{'s' if nodes > 1 else ''} x {config['gpus_per_node']})",
        _PRECISION_LABELS.get(config["precision"], config["precision"]),
        config["optimizer"],
        f"micro-batch {config['micro_batch']} x {config['seq_len']} tokens",
        f"grad-accum {config['grad_accum']}",
        f"checkpointing {config['checkpointing']}",
        f"{config['attention']} attention",
    ]
    if config["offload_optimizer"] != "none":
        parts.append(f"optimizer offload {config['offload_optimizer']}")
    if config["offload_params"] != "none":
        parts.append(f"parameter offload {config['offload_params']}")
    parts.append(f"{config['device']} device")
    return ", ".join(parts)


def _estimate_text(data: dict[str, Any], units: str, markdown: bool) -> str:
    model, per_gpu, per_node = data["model"], data["per_gpu"], data["per_node"]

    def heading(text: str) -> str:
        return f"### {text}" if markdown else text

    # A model given by its count alone is named after it ("7,500,000,000 params"): no need to repeat.
    name = "" if model["name"] == f"{model['params']:,} params" else f"{model['name']}: "
    out = [
        heading(
            f"{name}{model['params']:,} parameters ({model['trainable_params']:,} trainable);"
            f" activation model: {model['implementation']}"
        ),
        _describe_config(data),
        "",
        heading(f"Per GPU at the peak ({per_gpu['peak_step']} step, {per_gpu['peak_phase']})"),
        _tabulate(
            [[label, _amount(per_gpu[key], units)] for key, label in CATEGORY_LABELS.items()]
            + [["peak", _amount(per_gpu["peak"], units)]],
            ["category", units],
            markdown,
        ),
        "",
        heading(f"Per GPU by phase ({units})"),
        _tabulate(
            [
                [f"{row['step']} {row['phase']}"]
                + [_amount(row[key], units) for key in CATEGORY_LABELS]
                + [_amount(row["total"], units), _peak_marker(row, per_gpu)]
                for row in data["phases"]
            ],
            ["step phase", *_SHORT_LABELS.values(), "total", ""],
            markdown,
        ),
        "",
        heading("Per node"),
        (
            f"CPU RAM {_amount(per_node['cpu'], units)} {units} (pinned {_amount(per_node['pinned'], units)} {units}),"
            f" NVMe {_amount(per_node['nvme'], units)} {units}"
        ),
    ]
    if "fits" in data:
        free = data["gpu_memory"] - per_gpu["peak"]
        verdict = (
            f"yes, {_amount(free, units)} {units} to spare"
            if data["fits"]
            else f"no, {_amount(-free, units)} {units} over"
        )
        out += ["", f"Fits in {_amount(data['gpu_memory'], units)} {units} per GPU: {verdict}"]
    if data["notes"]:
        out += ["", heading("Notes")] + [f"- {note}" for note in data["notes"]]
    return "\n".join(out) + "\n"


def _peak_marker(row: dict[str, Any], per_gpu: dict[str, Any]) -> str:
    is_peak = (row["step"], row["phase"]) == (per_gpu["peak_step"], per_gpu["peak_phase"])
    return "<- peak" if is_peak else ""


def _estimate_csv(data: dict[str, Any], units: str) -> str:
    """The per-phase table, one row per (step, phase), sizes in `units` (named in the header)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["step", "phase", *(f"{key}_{units}" for key in CATEGORY_LABELS), f"total_{units}", "is_peak"])
    for row in data["phases"]:
        writer.writerow(
            [row["step"], row["phase"]]
            + [f"{bytes_in_unit(row[key], units):.4f}" for key in (*CATEGORY_LABELS, "total")]
            + [int(bool(_peak_marker(row, data["per_gpu"])))]
        )
    return buffer.getvalue()


def render_estimate(data: dict[str, Any], output_format: str = "table", units: str = "GiB") -> str:
    """`data` from `estimate_to_dict`, as text in `output_format` (one of FORMATS)."""
    if output_format == "json":
        return json.dumps(data, indent=2) + "\n"
    if output_format == "csv":
        return _estimate_csv(data, units)
    return _estimate_text(data, units, markdown=output_format == "markdown")


MODEL_COLUMNS = ("name", "params", "family", "layers", "hidden", "heads", "kv_heads", "experts", "vocab", "source")


def model_rows(specs: Iterable[Any]) -> list[dict[str, Any]]:
    """One row per catalogue model: its exact parameter count and shape (None where a model is
    known only by its count), by family, then by size."""
    from zeroplan.estimate.layout import param_layout

    rows = []
    for spec in specs:
        if spec.kind == "params":
            rows.append({column: None for column in MODEL_COLUMNS} | {"name": spec.name, "params": spec.params, "source": spec.source})
            continue
        rows.append(
            {
                "name": spec.name,
                "params": param_layout(spec).total_params,
                "family": spec.hf_model_type,
                "layers": spec.num_layers,
                "hidden": spec.hidden_size,
                "heads": spec.num_heads,
                "kv_heads": spec.kv_heads,
                "experts": spec.num_experts,
                "vocab": spec.vocab_size,
                "source": spec.source,
            }
        )
    return sorted(rows, key=lambda row: (row["family"] or "", row["params"]))


def render_models(rows: Sequence[dict[str, Any]], output_format: str = "table") -> str:
    """The catalogue rows of `model_rows` in `output_format`."""
    if output_format == "json":
        return json.dumps(list(rows), indent=2) + "\n"
    if output_format == "csv":
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=MODEL_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return buffer.getvalue()
    shown = ["name", "family", "params", "layers", "hidden", "heads", "kv_heads", "experts", "vocab"]
    table = [
        [f"{row[column]:,}" if column == "params" else ("" if row[column] is None else str(row[column])) for column in shown]
        for row in rows
    ]
    return _tabulate(table, shown, markdown=output_format == "markdown", left=2) + "\n"

"""`zeroplan compare`'s output: a `Comparison` (zeroplan.plan.grid) as a table, JSON, CSV or
Markdown. Formatting only."""

from __future__ import annotations

import csv
import io
import json
from typing import TYPE_CHECKING, Any

from zeroplan.errors import SpecError
from zeroplan.estimate.result import CATEGORY_NAMES
from zeroplan.estimate.serialize import per_gpu_to_dict, per_node_to_dict
from zeroplan.report.common import FORMATS, amount, table
from zeroplan.spec.units import UNIT_POWERS

if TYPE_CHECKING:
    from zeroplan.plan.grid import CompareRow, Comparison


def row_to_dict(row: CompareRow) -> dict[str, Any]:
    """One row of `zeroplan compare --format json`: bytes as ints, per GPU and per node as
    `zeroplan estimate --format json` has them."""
    return {
        "config": row.label,
        "zero_stage": row.training.zero_stage,
        "gpus": row.training.gpus,
        "offload": row.offload,
        "offload_optimizer": row.training.offload_optimizer.value,
        "offload_params": row.training.offload_params.value,
        "per_gpu": per_gpu_to_dict(row.estimate),
        "per_node": per_node_to_dict(row.estimate.per_node),
        "saving_vs_stage0_percent": None if row.saving_percent is None else round(row.saving_percent, 2),
        "fits": row.fits,
        "device": row.device_bytes,  # reserved and the memory outside the allocator (None: a CPU run)
    }


_SHORT = {"optimizer_states": "optim", "activations": "activ", "temporaries": "temps"}  # the wide table's headers
_HEADERS = ("config", "GPUs", *(_SHORT.get(name, name) for name in CATEGORY_NAMES), "peak",
            "peak phase", "CPU/node", "NVMe/node", "saving", "device", "fits")


def _table_rows(comparison: Comparison, units: str) -> list[list[str]]:
    rows = []
    for row in comparison.rows:
        peak = row.estimate.peak
        saving = "" if row.saving_percent is None else f"{row.saving_percent:.1f}%"
        fits = "" if row.fits is None else ("yes" if row.fits else "NO")
        amounts = [amount(size_bytes, units) for size_bytes in (*peak.categories, peak.total_bytes)]
        device = "" if row.device_bytes is None else amount(row.device_bytes, units)
        rows.append([row.label, str(row.training.gpus), *amounts, f"{peak.step.value} {peak.phase.value}",
                     amount(row.estimate.per_node.cpu_bytes, units), amount(row.estimate.per_node.nvme_bytes, units),
                     saving, device, fits])
    return rows


def comparison_to_dict(comparison: Comparison) -> dict[str, Any]:
    """`zeroplan compare --format json` (and `zeroplan.compare(...).to_dict()`): bytes as ints."""
    return {
        "model": comparison.model_name,
        "gpu_memory": comparison.gpu_memory_bytes,
        "budget": comparison.budget_bytes,
        "fits_on": comparison.fits_on,  # device: as `zeroplan estimate`'s fits; peak: the peak within the budget
        "rows": [row_to_dict(row) for row in comparison.rows],
        "skipped": list(comparison.skipped),
    }


def render_comparison(comparison: Comparison, fmt: str = "table", units: str = "GiB") -> str:
    """The comparison as a table (per-GPU bytes at the peak, in `units`), JSON (ints), CSV or Markdown."""
    if fmt == "json":
        return json.dumps(comparison_to_dict(comparison), indent=2)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(["config", "gpus", "offload", *(f"{c}_bytes" for c in CATEGORY_NAMES), "peak_bytes", "peak_step", "peak_phase",
                         "cpu_per_node_bytes", "nvme_per_node_bytes", "saving_vs_stage0_percent", "fits", "device_bytes"])
        for row in comparison.rows:
            data = row_to_dict(row)
            writer.writerow([data["config"], data["gpus"], data["offload"], *(data["per_gpu"][c] for c in CATEGORY_NAMES),
                             data["per_gpu"]["peak"], data["per_gpu"]["peak_step"], data["per_gpu"]["peak_phase"], data["per_node"]["cpu"],
                             data["per_node"]["nvme"], "" if data["saving_vs_stage0_percent"] is None else data["saving_vs_stage0_percent"],
                             "" if data["fits"] is None else data["fits"], "" if data["device"] is None else data["device"]])
        return out.getvalue()
    if fmt not in FORMATS:
        raise SpecError(f"--format: unknown format {fmt!r}; use {', '.join(FORMATS)}")
    headers = [h if h in ("config", "GPUs", "peak phase", "saving", "fits") else f"{h} ({units})" for h in _HEADERS]
    if all(row.device_bytes is None for row in comparison.rows):  # a CPU run: no device figures
        headers.remove(f"device ({units})")
        text_rows = [row[:-2] + row[-1:] for row in _table_rows(comparison, units)]
    else:
        text_rows = _table_rows(comparison, units)
    text = table(text_rows, headers, markdown=fmt == "markdown")
    lines = [f"{comparison.model_name}: per-GPU memory at the peak, {units} ({UNIT_POWERS[units]} bytes); "
             "saving = peak below the ZeRO-0 baseline on the same GPU count", text]
    if comparison.budget_bytes is not None and comparison.fits_on == "device":
        lines.append(f"fits = the allocator's replay stays within the GPU and device <= {amount(comparison.budget_bytes, units)} "
                     f"{units} (as zeroplan estimate's fits; device = reserved + the memory outside the allocator)")
    elif comparison.budget_bytes is not None:
        lines.append(f"fits = peak <= {amount(comparison.budget_bytes, units)} {units}")
    lines.extend(f"note: {note}" for note in comparison.skipped)
    return "\n".join(lines) + "\n"

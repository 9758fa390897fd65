"""Pictures of a comparison: one stacked bar per configuration, the bytes live at its peak by
category, and the GPU memory as a line. matplotlib is an optional extra (`zeroplan[plot]`),
imported only here and only when a picture is asked for."""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

from zeroplan.errors import MissingDependencyError, SpecError
from zeroplan.estimate.result import CATEGORY_NAMES
from zeroplan.spec.files import write_atomic
from zeroplan.spec.units import bytes_in_unit

if TYPE_CHECKING:
    from zeroplan.plan.grid import Comparison

_LABELS = {
    "params": "parameters",
    "grads": "gradients",
    "optimizer_states": "optimizer states",
    "activations": "activations",
    "buffers": "buffers",
    "temporaries": "temporaries",
    "overhead": "overhead",
}
_MISSING = "--plot needs matplotlib: pip install 'zeroplan[plot]'"
_COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#8C8C8C")


def check_plotting() -> None:
    """Refuse a picture that cannot be drawn before anything is computed (matplotlib missing), without
    importing matplotlib, which takes longer than the estimates."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise MissingDependencyError(_MISSING)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise MissingDependencyError(_MISSING) from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_comparison(comparison: Comparison, path: str | Path, units: str = "GiB") -> Path:
    """Write a PNG (or any format matplotlib knows from the suffix) of `comparison` to `path`."""
    if not comparison.rows:
        raise SpecError("--plot: nothing to draw, every configuration of the grid was skipped")
    plt = _pyplot()
    rows = comparison.rows
    labels = [f"{row.label.replace(' + ', chr(10) + '+ ')}\n{row.training.gpus} GPUs" for row in rows]
    figure, axes = plt.subplots(figsize=(max(6.0, 1.1 * len(rows) + 2), 5.5))
    bottoms = [0.0] * len(rows)
    for category, colour in zip(CATEGORY_NAMES, _COLOURS):
        heights = [bytes_in_unit(getattr(row.estimate.peak.categories, category), units) for row in rows]
        if not any(heights):
            continue
        axes.bar(range(len(rows)), heights, bottom=bottoms, color=colour, label=_LABELS[category], width=0.7)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for index, row in enumerate(rows):
        text = f"{bottoms[index]:,.1f}"
        if row.saving_percent is not None and row.training.zero_stage > 0:
            text += f"\n-{row.saving_percent:.0f}%" if row.saving_percent >= 0 else f"\n+{-row.saving_percent:.0f}%"
        if row.fits is False:
            text += "\ndoes not fit"
        axes.annotate(text, (index, bottoms[index]), ha="center", va="bottom", fontsize=8,
                      color="#B00000" if row.fits is False else "black")
        if index and row.training.gpus != rows[index - 1].training.gpus:  # separate the GPU-count groups
            axes.axvline(index - 0.5, color="grey", linestyle=":", linewidth=1)
    if comparison.gpu_memory_bytes is not None:
        memory = bytes_in_unit(comparison.gpu_memory_bytes, units)
        axes.axhline(memory, color="black", linestyle="--", linewidth=1, label=f"GPU memory {memory:,.0f} {units}")
    axes.set_xticks(range(len(rows)), labels, fontsize=8)
    axes.set_ylabel(f"per-GPU memory at the peak ({units})")
    axes.set_title(f"{comparison.model_name}: memory per GPU by ZeRO configuration")
    axes.set_ylim(0, max(bottoms + [bytes_in_unit(comparison.gpu_memory_bytes or 0, units)]) * 1.2)
    handles, names = axes.get_legend_handles_labels()
    axes.legend(handles[::-1], names[::-1], fontsize=8, loc="upper right")  # same order as the stack
    figure.tight_layout()
    path = Path(path)
    picture = io.BytesIO()  # drawn whole first, then written as every output file is (spec/files.py)
    try:
        figure.savefig(picture, dpi=120, format=path.suffix.lstrip(".").lower() or "png")
    except ValueError as error:  # "Format 'txt' is not supported (supported formats: ...)"
        raise SpecError(f"--plot: {error}") from None
    finally:
        plt.close(figure)
    write_atomic(path, picture.getvalue(), "--plot")
    return path

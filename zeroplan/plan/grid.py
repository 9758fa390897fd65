"""`zeroplan compare`: one estimate per configuration of a grid (ZeRO stage x GPU count x offload),
side by side, with the saving of each against the stage-0 baseline on the same GPU count.

Offload targets name where the offloaded states go, and what is offloaded follows the stage, as in
the ZeRO-Offload / ZeRO-Infinity configurations users know:
- `none`: nothing offloaded;
- `cpu` / `nvme`: the optimizer states at stages 1-2 (ZeRO-Offload), the optimizer states and the
  parameters at stage 3 (ZeRO-Infinity);
- `cpu-optimizer` / `nvme-optimizer`: the optimizer states only, at any stage >= 1 (the classic
  "ZeRO-3 + optimizer offload" row).
Combinations the engine cannot run (offload at stage 0, engine torch beyond stage 1, ...) are
skipped with the reason, in `Comparison.skipped`.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from zeroplan.errors import SpecError
from zeroplan.estimate.result import Estimate
from zeroplan.estimate.serialize import CATEGORIES, per_gpu_to_dict, per_node_to_dict
from zeroplan.spec.training import Engine, Offload, TrainingSpec
from zeroplan.spec.units import UNIT_POWERS, bytes_in_unit

OFFLOAD_CHOICES = ("none", "cpu", "nvme", "cpu-optimizer", "nvme-optimizer")
FORMATS = ("table", "json", "csv", "markdown")


@dataclass(frozen=True)
class CompareRow:
    """One configuration: its training spec, its estimate, and how it compares."""

    label: str
    offload: str  # the grid's offload choice, one of OFFLOAD_CHOICES
    training: TrainingSpec
    estimate: Estimate
    baseline_peak_bytes: int | None  # stage-0 peak on the same GPU count, if it could be estimated
    fits: bool | None  # None when no GPU memory was given

    @property
    def saving_percent(self) -> float | None:
        """How much lower the peak is than the stage-0 baseline's, in percent of the baseline."""
        if self.baseline_peak_bytes is None:
            return None
        return 100.0 * (1 - self.estimate.peak_bytes / self.baseline_peak_bytes)

    def as_dict(self) -> dict:
        return {
            "config": self.label,
            "zero_stage": self.training.zero_stage,
            "gpus": self.training.gpus,
            "offload": self.offload,
            "offload_optimizer": self.training.offload_optimizer.value,
            "offload_params": self.training.offload_params.value,
            "per_gpu": per_gpu_to_dict(self.estimate),  # the shapes of `zeroplan estimate --format json`
            "per_node": per_node_to_dict(self.estimate.per_node),
            "saving_vs_stage0_percent": None if self.saving_percent is None else round(self.saving_percent, 2),
            "fits": self.fits,
        }


@dataclass(frozen=True)
class Comparison:
    model_name: str
    rows: tuple[CompareRow, ...]
    skipped: tuple[str, ...]  # grid points that were not estimated, with the reason (and baseline notes)
    gpu_memory_bytes: int | None
    budget_bytes: int | None  # gpu memory less the headroom; a row fits when its peak <= this


def _offloads(stage: int, choice: str) -> tuple[Offload, Offload]:
    """(offload_optimizer, offload_params) for a grid offload choice at `stage`."""
    if choice == "none":
        return Offload.NONE, Offload.NONE
    target = Offload(choice.split("-")[0])
    if choice.endswith("-optimizer") or stage < 3:
        return target, Offload.NONE
    return target, target


def _label(training: TrainingSpec) -> str:
    text = f"ZeRO-{training.zero_stage}"
    if training.offload_optimizer != Offload.NONE:
        text += f" + opt->{training.offload_optimizer.value}"
    if training.offload_params != Offload.NONE:
        text += f" + params->{training.offload_params.value}"
    return text


def _spec(base: TrainingSpec, **changes) -> TrainingSpec | str:
    values = base.model_dump()
    values.update(changes)
    if base.gpus_per_node is not None and values["gpus"] < base.gpus_per_node:
        values["gpus_per_node"] = values["gpus"]  # a world smaller than one node is that node
    try:
        return TrainingSpec.model_validate(values)
    except ValidationError as error:
        return "; ".join(str(item["msg"]).removeprefix("Value error, ") for item in error.errors())


def compare(
    model,
    base: TrainingSpec,
    stages: Sequence[int] = (0, 1, 2, 3),
    gpu_counts: Sequence[int] | None = None,
    offloads: Sequence[str] = ("none",),
    gpu_memory_bytes: int | None = None,
    headroom: float = 0.0,
    estimator: Callable[..., Estimate] | None = None,
) -> Comparison:
    """Estimate every (stage, GPU count, offload) of the grid over the `base` training spec."""
    if estimator is None:
        from zeroplan.estimate import estimate as estimator
    for choice in offloads:
        if choice not in OFFLOAD_CHOICES:
            raise SpecError(f"--offload: unknown choice {choice!r}; use {', '.join(OFFLOAD_CHOICES)}")
    for stage in stages:
        if stage not in (0, 1, 2, 3):
            raise SpecError(f"--zero: stage must be 0, 1, 2 or 3, got {stage}")
    if not 0 <= headroom < 1:
        raise SpecError(f"--headroom: must be in [0, 1), got {headroom}")
    budget = None if gpu_memory_bytes is None else int(gpu_memory_bytes * (1 - headroom))
    rows, skipped = [], []
    for gpus in gpu_counts or (base.gpus,):
        baseline = _spec(base, zero_stage=0, gpus=gpus, offload_optimizer=Offload.NONE, offload_params=Offload.NONE)
        if isinstance(baseline, str) and base.engine == Engine.FSDP2:
            # FSDP2 has no stage 0: the unsharded baseline of a PyTorch user is DDP.
            baseline = _spec(base, engine=Engine.TORCH, zero_stage=0, gpus=gpus, offload_optimizer=Offload.NONE,
                             offload_params=Offload.NONE)
            if isinstance(baseline, TrainingSpec):
                skipped.append(f"baseline on {gpus} GPUs: DDP (engine torch, stage 0), as fsdp2 has no stage 0")
        baseline_estimate = estimator(model, baseline) if isinstance(baseline, TrainingSpec) else None
        if baseline_estimate is None:
            skipped.append(f"no stage-0 baseline on {gpus} GPUs ({baseline}): savings not shown")
        for stage in stages:
            seen = set()
            for choice in offloads:
                offload_optimizer, offload_params = _offloads(stage, choice)
                if (offload_optimizer, offload_params) in seen:
                    continue  # e.g. cpu and cpu-optimizer are the same at stages 1-2
                seen.add((offload_optimizer, offload_params))
                training = _spec(base, zero_stage=stage, gpus=gpus, offload_optimizer=offload_optimizer, offload_params=offload_params)
                if isinstance(training, str):
                    skipped.append(f"skipped ZeRO-{stage} offload {choice} on {gpus} GPUs: {training}")
                    continue
                if training == baseline and baseline_estimate is not None:
                    estimate = baseline_estimate
                else:
                    estimate = estimator(model, training)
                rows.append(
                    CompareRow(
                        label=_label(training),
                        offload=choice,
                        training=training,
                        estimate=estimate,
                        baseline_peak_bytes=None if baseline_estimate is None else baseline_estimate.peak_bytes,
                        fits=None if budget is None else estimate.peak_bytes <= budget,
                    )
                )
    return Comparison(getattr(model, "name", "model"), tuple(rows), tuple(skipped), gpu_memory_bytes, budget)


# -- rendering -----------------------------------------------------------------------------------
_HEADERS = ("config", "GPUs", "params", "grads", "optim", "activ", "buffers", "temps", "overhead", "peak",
            "peak phase", "CPU/node", "NVMe/node", "saving", "fits")


def _table_rows(comparison: Comparison, units: str) -> list[list[str]]:
    def amount(size_bytes: int) -> str:
        return f"{bytes_in_unit(size_bytes, units):,.2f}"

    table = []
    for row in comparison.rows:
        peak = row.estimate.peak
        cats = peak.categories
        saving = "" if row.saving_percent is None else f"{row.saving_percent:.1f}%"
        fits = "" if row.fits is None else ("yes" if row.fits else "NO")
        table.append([
            row.label, str(row.training.gpus), amount(cats.params), amount(cats.grads), amount(cats.optimizer_states),
            amount(cats.activations), amount(cats.buffers), amount(cats.temporaries), amount(cats.overhead),
            amount(peak.total_bytes), f"{peak.step.value} {peak.phase.value}", amount(row.estimate.per_node.cpu_bytes),
            amount(row.estimate.per_node.nvme_bytes), saving, fits,
        ])
    return table


def render_comparison(comparison: Comparison, fmt: str = "table", units: str = "GiB") -> str:
    """The comparison as a table (per-GPU bytes at the peak, in `units`), JSON (ints), CSV or Markdown."""
    if fmt == "json":
        return json.dumps(
            {
                "model": comparison.model_name,
                "gpu_memory": comparison.gpu_memory_bytes,
                "budget": comparison.budget_bytes,
                "rows": [row.as_dict() for row in comparison.rows],
                "skipped": list(comparison.skipped),
            },
            indent=2,
        )
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(["config", "gpus", "offload", *(f"{c}_bytes" for c in CATEGORIES), "peak_bytes", "peak_step", "peak_phase",
                         "cpu_per_node_bytes", "nvme_per_node_bytes", "saving_vs_stage0_percent", "fits"])
        for row in comparison.rows:
            data = row.as_dict()
            writer.writerow([data["config"], data["gpus"], data["offload"], *(data["per_gpu"][c] for c in CATEGORIES),
                             data["per_gpu"]["peak"], data["per_gpu"]["peak_step"], data["per_gpu"]["peak_phase"], data["per_node"]["cpu"],
                             data["per_node"]["nvme"], "" if data["saving_vs_stage0_percent"] is None else data["saving_vs_stage0_percent"],
                             "" if data["fits"] is None else data["fits"]])
        return out.getvalue()
    if fmt not in FORMATS:
        raise SpecError(f"--format: unknown format {fmt!r}; use {', '.join(FORMATS)}")
    from tabulate import tabulate

    headers = [h if h in ("config", "GPUs", "peak phase", "saving", "fits") else f"{h} ({units})" for h in _HEADERS]
    text = tabulate(_table_rows(comparison, units), headers=headers, tablefmt="github" if fmt == "markdown" else "simple",
                    disable_numparse=True, colalign=("left",) + ("right",) * (len(headers) - 1))
    lines = [f"{comparison.model_name}: per-GPU memory at the peak, {units} ({UNIT_POWERS[units]} bytes); "
             "saving = peak below the ZeRO-0 baseline on the same GPU count", text]
    if comparison.budget_bytes is not None:
        lines.append(f"fits = peak <= {bytes_in_unit(comparison.budget_bytes, units):,.2f} {units}")
    lines.extend(f"note: {note}" for note in comparison.skipped)
    return "\n".join(lines) + "\n"

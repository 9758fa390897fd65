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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from zeroplan.errors import FieldError, SpecError
from zeroplan.estimate.result import Estimate
from zeroplan.spec.training import Engine, Offload, TrainingSpec, config_label

OFFLOAD_CHOICES = ("none", "cpu", "nvme", "cpu-optimizer", "nvme-optimizer")


class OnDevice(NamedTuple):
    """A configuration on the GPU, as `zeroplan estimate` decides its fits (estimate/device/estimate.py): its worst
    rank's device bytes (reserved and the memory outside the allocator) and whether a rank's allocator replay ran
    out of the GPU's capacity."""

    device_bytes: int
    ran_out: bool


@dataclass(frozen=True)
class CompareRow:
    """One configuration: its training spec, its estimate, and how it compares."""

    label: str
    offload: str  # the grid's offload choice, one of OFFLOAD_CHOICES
    training: TrainingSpec
    estimate: Estimate
    baseline_peak_bytes: int | None  # stage-0 peak on the same GPU count, if it could be estimated
    fits: bool | None  # None when no GPU memory was given
    device_bytes: int | None = None  # its device figure (OnDevice), None where there is none (a CPU run)

    @property
    def saving_percent(self) -> float | None:
        """How much lower the peak is than the stage-0 baseline's, in percent of the baseline."""
        if self.baseline_peak_bytes is None:
            return None
        return 100.0 * (1 - self.estimate.peak_bytes / self.baseline_peak_bytes)


@dataclass(frozen=True)
class Comparison:
    model_name: str
    rows: tuple[CompareRow, ...]
    skipped: tuple[str, ...]  # grid points that were not estimated, with the reason (and baseline notes)
    gpu_memory_bytes: int | None
    budget_bytes: int | None  # gpu memory less the headroom; a row fits when its device bytes (else peak) <= this
    fits_on: str = "peak"  # "device": the rows' fits follow their device figure, as `zeroplan estimate`'s


def _offloads(stage: int, choice: str) -> tuple[Offload, Offload]:
    """(offload_optimizer, offload_params) for a grid offload choice at `stage`."""
    if choice == "none":
        return Offload.NONE, Offload.NONE
    target = Offload(choice.split("-")[0])
    if choice.endswith("-optimizer") or stage < 3:
        return target, Offload.NONE
    return target, target


def _label(training: TrainingSpec) -> str:
    """What the grid varies: the stage and the offloads (the base's checkpointing is every row's)."""
    return config_label(training.zero_stage, training.offload_optimizer, training.offload_params)


def _spec(base: TrainingSpec, **changes) -> TrainingSpec | str:
    """`base` with `changes`, or why that combination is invalid."""
    try:
        return base.varied(**changes)
    except SpecError as error:
        return str(error)


def compare(
    model,
    base: TrainingSpec,
    stages: Sequence[int] = (0, 1, 2, 3),
    gpu_counts: Sequence[int] | None = None,
    offloads: Sequence[str] = ("none",),
    gpu_memory_bytes: int | None = None,
    headroom: float = 0.0,
    estimator: Callable[..., Estimate] | None = None,
    on_device: Callable[[TrainingSpec], OnDevice | None] | None = None,
) -> Comparison:
    """Estimate every (stage, GPU count, offload) of the grid over the `base` training spec. With `on_device`, a row
    fits as `zeroplan estimate`'s fits: its allocator replay stays within the GPU and its device bytes within the
    budget (one replay per row); without it, or where it gives None (a CPU run), its peak within the budget."""
    if estimator is None:
        from zeroplan.estimate import estimate as estimator
    for choice in offloads:
        if choice not in OFFLOAD_CHOICES:
            raise FieldError("offloads", f"unknown choice {choice!r}; use {', '.join(OFFLOAD_CHOICES)}")
    for stage in stages:
        if stage not in (0, 1, 2, 3):
            raise FieldError("stages", f"stage must be 0, 1, 2 or 3, got {stage}")
    if not 0 <= headroom < 1:
        raise FieldError("headroom", f"must be in [0, 1), got {headroom}")
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
                device = None if on_device is None else on_device(training)
                if budget is None:
                    fits = None
                elif device is None:
                    fits = estimate.peak_bytes <= budget
                else:
                    fits = not device.ran_out and device.device_bytes <= budget
                rows.append(
                    CompareRow(
                        label=_label(training),
                        offload=choice,
                        training=training,
                        estimate=estimate,
                        baseline_peak_bytes=None if baseline_estimate is None else baseline_estimate.peak_bytes,
                        fits=fits,
                        device_bytes=None if device is None else device.device_bytes,
                    )
                )
    if not rows:  # an empty table with exit 0 would read as an answer
        raise SpecError(f"nothing to compare: every combination was skipped ({'; '.join(skipped)})")
    fits_on = "device" if rows and all(row.device_bytes is not None for row in rows) else "peak"
    return Comparison(getattr(model, "name", "model"), tuple(rows), tuple(skipped), gpu_memory_bytes, budget, fits_on)

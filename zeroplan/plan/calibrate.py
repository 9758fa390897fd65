"""`plan --calibrate MEASURE.json` (and `estimate --calibrate`): rescale the compute efficiency so that the step
time of a measured configuration is priced at its measured step time.

A measurement (`zeroplan measure --output`) records each rank's wall time per step (`ranks[].step_times_s`) and the
configuration it ran (`estimate.config`). The measured step is the slowest rank's median over the steady steps
(steps 2 on: the first builds the optimizer states). The step-time model prices the same configuration with the
plan's rates; the calibration factor c multiplies the compute efficiency (matmuls and attention: the compute and
recompute terms), and is the c at which the priced step equals the measured one. The priced step falls as c
grows (its compute terms are FLOPs over rates times c, the exposed collectives never grow), so c is found by
bisection on log c. The arithmetic is the same whatever the device; a CPU measurement calibrates to the CPU
(said in a note). docs/throughput.md says when a calibration transfers (the same GPU kind and program).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import NamedTuple

from zeroplan.errors import FieldError, SpecError
from zeroplan.plan.rates import Rates
from zeroplan.plan.step_time import step_time
from zeroplan.spec.training import TrainingSpec


class Calibration(NamedTuple):
    factor: float  # Rates.calibration
    measured_s: float
    note: str


def measured_step_seconds(measure: dict) -> float:
    """The slowest rank's median step time over the steady steps (2 on) of a `zeroplan measure` JSON."""
    medians = []
    for rank in measure.get("ranks", []):
        steady = list(rank.get("step_times_s", []))[1:]
        if steady:
            medians.append(statistics.median(steady))
    if not medians:
        raise FieldError("calibrate", "the measurement has no steady step times (ranks[].step_times_s from step 2 on): "
                         "a measurement of 3 steps or more is needed")
    return max(medians)


def calibrate(model, measure: dict, rates: Rates) -> Calibration:
    """The calibration factor that prices `measure`'s configuration at its measured step time under `rates`."""
    estimate = measure.get("estimate") or {}
    name = (estimate.get("model") or {}).get("name")
    if name != getattr(model, "name", None):
        raise FieldError("calibrate", f"the measurement is of model {name!r}, not {getattr(model, 'name', None)!r}: "
                         "calibrate with a measurement of the model planned")
    try:
        training = TrainingSpec.model_validate(estimate["config"])
    except (KeyError, ValueError) as error:
        raise FieldError("calibrate", f"cannot read the measured configuration (estimate.config): {error}") from None
    measured = measured_step_seconds(measure)

    def priced(factor: float) -> float:
        return step_time(model, training, rates.model_copy(update={"calibration": factor})).seconds

    low, high = -30.0, 30.0  # log c: a factor between e^-30 and e^30
    if not priced(math.exp(high)) <= measured <= priced(math.exp(low)):
        raise SpecError(f"calibrate: the measured step ({measured:.4g} s) is shorter than the step's time outside its "
                        "compute as priced; check the rates (bandwidths) given")
    for _ in range(100):  # bisection on log c; the priced step falls as c grows
        middle = (low + high) / 2
        low, high = (middle, high) if priced(math.exp(middle)) > measured else (low, middle)
    note = (f"compute efficiency calibrated x{math.exp(low):.3g} from a measured step of {measured:.4g} s "
            f"({measure.get('device', 'cuda')} device)")
    if measure.get("device") == "cpu":
        note += ": a CPU measurement prices the CPU, not the GPU planned"
    return Calibration(math.exp(low), measured, note)


def read_measurement(path: str) -> dict:
    """A `zeroplan measure --format json` document, or one line naming the option."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise FieldError("calibrate", f"cannot read {path}: {error}") from None

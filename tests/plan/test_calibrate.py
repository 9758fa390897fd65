"""`--calibrate MEASURE.json`: the compute efficiency rescaled so that a measured configuration is priced at its
measured step time (zeroplan/plan/calibrate.py, docs/throughput.md "Calibration"). The arithmetic is the same on any
device: tests/data/measure/tiny-llama-fsdp2-cpu.json is `zeroplan measure tiny-llama --engine fsdp2 --zero 3
--nproc 2 --precision fp32 --steps 3 --micro-batch 2 --seq-len 128 --output FILE` on this machine's CPU (gloo)."""

from __future__ import annotations

import json
import statistics

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.errors import FieldError
from zeroplan.importers.catalog import resolve_model
from zeroplan.importers.gpus import get_gpu
from zeroplan.plan.calibrate import calibrate, measured_step_seconds
from zeroplan.plan.rates import rates_for
from zeroplan.plan.step_time import step_time
from zeroplan.spec.training import TrainingSpec
from tests.paths import DATA

MEASURED = DATA / "measure" / "tiny-llama-fsdp2-cpu.json"


def _measure() -> dict:
    return json.loads(MEASURED.read_text())


def test_the_measured_step_is_the_slowest_ranks_median_over_the_steady_steps():
    data = _measure()
    medians = [statistics.median(rank["step_times_s"][1:]) for rank in data["ranks"]]
    assert measured_step_seconds(data) == max(medians)


def test_the_calibrated_rates_price_the_measured_configuration_at_its_measured_step():
    model, data = resolve_model("tiny-llama"), _measure()
    rates = rates_for(get_gpu("h100-80gb"))
    found = calibrate(model, data, rates)
    training = TrainingSpec.model_validate(data["estimate"]["config"])
    priced = step_time(model, training, rates.model_copy(update={"calibration": found.factor}))
    assert priced.seconds == pytest.approx(measured_step_seconds(data), rel=1e-9)
    assert found.factor < 1  # a CPU is far slower than an H100's rates
    assert found.note.endswith("a CPU measurement prices the CPU, not the GPU planned")


def test_a_measurement_of_another_model_or_without_steady_steps_is_refused():
    data = _measure()
    with pytest.raises(FieldError, match="^calibrate: the measurement is of model 'tiny-llama', not 'gpt2'"):
        calibrate(resolve_model("gpt2"), data, rates_for(None))
    for rank in data["ranks"]:
        rank["step_times_s"] = rank["step_times_s"][:1]
    with pytest.raises(FieldError, match="^calibrate: the measurement has no steady step times"):
        calibrate(resolve_model("tiny-llama"), data, rates_for(None))


def test_plan_and_estimate_calibrate_from_the_command_line():
    runner = CliRunner()
    planned = runner.invoke(cli, ["plan", "tiny-llama", "--gpu", "h100-80gb", "--gpus", "2", "--calibrate", str(MEASURED)])
    assert planned.exit_code == 0, planned.output
    assert "calibrated x" in planned.output and "note: compute efficiency calibrated x" in planned.output
    estimated = runner.invoke(cli, ["estimate", "tiny-llama", "--gpu", "h100-80gb", "--gpus", "2", "--calibrate",
                                    str(MEASURED), "--format", "json"])
    assert estimated.exit_code == 0, estimated.output
    factor = calibrate(resolve_model("tiny-llama"), _measure(), rates_for(get_gpu("h100-80gb"))).factor
    assert json.loads(estimated.stdout)["step"]["knobs"]["calibration"] == factor
    wrong = runner.invoke(cli, ["plan", "gpt2", "--gpu", "h100-80gb", "--gpus", "2", "--calibrate", str(MEASURED)])
    assert wrong.exit_code == 2 and len(wrong.output.strip().splitlines()) == 1
    assert "Error: --calibrate: the measurement is of model 'tiny-llama', not 'gpt2'" in wrong.output

"""The Hugging Face Trainer with a PEFT model (recipe hf-trainer, issue 12): what it does that
zeroplan's own loop does not, held to the source and to the grid's measured rows."""

from __future__ import annotations

import pytest

from zeroplan.estimate import estimate
from zeroplan.estimate.adapters.trainer import adapters_stay_fp32
from zeroplan.estimate.result import Phase, Step
from zeroplan.measure.grid import GRID, row_specs
from zeroplan.spec.training import TrainingSpec

LORA = {"rank": 8, "targets": ["all-linear"]}
ZERO3_ROW = "trainer-lora-r8-all-linear/tiny-llama/deepspeed-3/bf16/nockpt/2x128/w2/hf-trainer"


def _training(**fields) -> TrainingSpec:
    base = {"engine": "deepspeed", "zero_stage": 3, "gpus": 2, "precision": "bf16", "recipe": "hf-trainer", "lora": LORA}
    return TrainingSpec.model_validate(base | fields)


@pytest.mark.parametrize("fields, stays", [
    ({}, True),  # from_pretrained under zero.Init, get_peft_model after it: engine.py casts nothing
    ({"precision": "fp32"}, False),  # nothing to cast
    ({"zero_stage": 2}, False),  # no zero.Init: engine.py casts the whole module, adapters included
    ({"recipe": "plain"}, False),  # zeroplan's loop adds the adapters inside zero.Init
    ({"model_init": "host"}, False),  # a model built whole is cast whole
    ({"lora": None}, False),
])
def test_the_trainers_adapters_stay_fp32_only_when_zero_init_built_the_base(fields, stays):
    assert adapters_stay_fp32(_training(**fields)) is stays


def test_zero3_params_with_fp32_adapters_equal_the_measured_row():
    # measured on 2 gloo ranks (zeroplan validate --rows 'trainer-lora-*deepspeed-3/bf16/nockpt*'), both ranks:
    # the params category at the steady backward peak and at the first step's
    model, training = row_specs(next(row for row in GRID if row.id == ZERO3_ROW))
    result = estimate(model, training)
    params = {p.step: p.categories.params for p in result.phases if p.phase == Phase.BACKWARD}
    assert params == {Step.STEADY: 658_304, Step.FIRST: 575_104}


def test_the_adapter_split_of_the_params_equals_the_measured_row():
    model, training = row_specs(next(row for row in GRID if row.id == ZERO3_ROW))
    parts = estimate(model, training).param_parts
    assert (parts.base_bytes, parts.adapter_bytes) == (501_632, 156_672)  # measured at the steady peak


def test_trainer_rows_with_adapters_have_their_own_prefix():
    rows = [row for row in GRID if row.lora is not None and row.recipe == "hf-trainer"]
    assert len(rows) >= 5 and all(row.id.startswith(("trainer-lora-", "trainer-qlora-")) for row in rows)


@pytest.mark.distributed
@pytest.mark.slow
def test_the_trainer_runs_lora_under_zero3_with_its_auto_threshold(deepspeed_ops):
    """The Trainer's "auto" persistence threshold (10 x hidden) partitions some adapters; both ranks
    finish (the count reads no parameter through ZeRO-3's gathering getter) and hold the fp32
    adapters the estimate counts."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("peft")
    deepspeed_ops("deepspeed_shm_comm")
    from zeroplan.measure.launcher import run_measurement

    model, training = row_specs(next(row for row in GRID if row.id == ZERO3_ROW))
    result = run_measurement(model, training, nproc=2, backend="gloo", steps=2, timeout_s=300)
    assert any("PeftModelForCausalLM" in note for note in result.notes)
    from zeroplan.measure.comparison import run_peaks

    steady = run_peaks(result.to_json_dict())["steady"]
    assert [peak.categories["params"] for peak in steady] == [658_304, 658_304]

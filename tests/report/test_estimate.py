"""Reporting: the JSON contract of an estimate, and its table / CSV / Markdown renderings.

The estimates here are built by hand from the result types, so every expected figure is known
independently of the estimator.
"""

from __future__ import annotations

import csv
import io
import json

import pytest

from zeroplan.estimate.result import (
    CategoryBytes,
    Estimate,
    ModelSummary,
    NodeBytes,
    Phase,
    PhaseBytes,
    Step,
)
from zeroplan.estimate.result import CATEGORY_NAMES
from zeroplan.estimate.serialize import estimate_to_dict, model_rows, single_rank
from zeroplan.report.common import CATEGORY_LABELS
from zeroplan.report.estimate import render_estimate, render_models
from zeroplan.spec.training import TrainingSpec

GIB = 2**30

# A ZeRO-3 step on one GPU, in whole GiB so that renderings are easy to read back.
PHASES = (
    PhaseBytes(Step.FIRST, Phase.INIT, CategoryBytes(params=1 * GIB, overhead=1 * GIB)),
    PhaseBytes(Step.FIRST, Phase.FORWARD, CategoryBytes(params=1 * GIB, activations=6 * GIB, buffers=2 * GIB, overhead=1 * GIB)),
    PhaseBytes(Step.FIRST, Phase.OPTIMIZER_STEP, CategoryBytes(params=1 * GIB, grads=1 * GIB, optimizer_states=4 * GIB, temporaries=3 * GIB, overhead=1 * GIB)),
    PhaseBytes(
        Step.STEADY,
        Phase.BACKWARD,
        CategoryBytes(params=1 * GIB, grads=1 * GIB, optimizer_states=4 * GIB, activations=5 * GIB, buffers=2 * GIB, temporaries=1 * GIB, overhead=1 * GIB),
    ),
    PhaseBytes(Step.STEADY, Phase.OPTIMIZER_STEP, CategoryBytes(params=1 * GIB, grads=1 * GIB, optimizer_states=4 * GIB, temporaries=3 * GIB, overhead=1 * GIB)),
)
ESTIMATE = Estimate(
    model=ModelSummary(name="llama-2-7b", params=6_738_415_616, trainable_params=6_738_415_616, implementation="transformers LlamaForCausalLM"),
    engine="deepspeed",
    phases=PHASES,
    per_node=NodeBytes(cpu_bytes=10 * GIB, pinned_bytes=4 * GIB, nvme_bytes=0),
    notes=("reduce bucket at DeepSpeed's default 5e8 elements",),
)
TRAINING = TrainingSpec(engine="deepspeed", zero_stage=3, gpus=16)


def test_json_contract_holds_every_documented_key_as_bytes():
    data = estimate_to_dict(single_rank(ESTIMATE, TRAINING, 32), TRAINING)
    assert data["model"] == {
        "name": "llama-2-7b",
        "params": 6_738_415_616,
        "trainable_params": 6_738_415_616,
        "implementation": "transformers LlamaForCausalLM",
    }
    per_gpu = data["per_gpu"]
    assert (per_gpu["peak_step"], per_gpu["peak_phase"]) == ("steady", "backward")
    assert per_gpu["peak"] == 15 * GIB
    for key in ("params", "grads", "optimizer_states", "activations", "buffers", "temporaries", "overhead", "peak"):
        assert type(per_gpu[key]) is int, key
    # The categories are the bytes live at the peak, and they add up to it.
    assert sum(per_gpu[key] for key in CATEGORY_NAMES) == per_gpu["peak"]
    assert per_gpu["activations"] == 5 * GIB
    assert data["per_node"] == {"cpu": 10 * GIB, "pinned": 4 * GIB, "nvme": 0, "unified": 0}
    assert [(row["step"], row["phase"], row["total"]) for row in data["phases"]] == [
        ("first", "init", 2 * GIB),
        ("first", "forward", 10 * GIB),
        ("first", "optimizer_step", 10 * GIB),
        ("steady", "backward", 15 * GIB),
        ("steady", "optimizer_step", 10 * GIB),
    ]
    assert data["notes"] == ["reduce bucket at DeepSpeed's default 5e8 elements"]
    assert "fits" not in data and "gpu_memory" not in data
    json.dumps(data)  # plain data only


def test_json_config_reads_back_as_the_same_training_spec_with_gpus_per_node_resolved():
    config = estimate_to_dict(single_rank(ESTIMATE, TRAINING, 32), TRAINING)["config"]
    assert config["gpus_per_node"] == 8  # min(16, 8)
    assert config["zero_stage"] == 3 and config["precision"] == "bf16"
    assert TrainingSpec.model_validate(config) == TRAINING.model_copy(update={"gpus_per_node": 8})


@pytest.mark.parametrize("gpu_memory, fits", [(16 * GIB, True), (15 * GIB, True), (15 * GIB - 1, False)])
def test_fits_compares_the_peak_with_the_gpu_memory(gpu_memory, fits):
    data = estimate_to_dict(single_rank(ESTIMATE, TRAINING, 32), TRAINING, gpu_memory_bytes=gpu_memory)
    assert data["fits"] is fits
    assert data["gpu_memory"] == gpu_memory


def test_table_is_labelled_in_gib_by_default():
    text = render_estimate(estimate_to_dict(single_rank(ESTIMATE, TRAINING, 32), TRAINING, gpu_memory_bytes=80 * GIB))
    assert "llama-2-7b: 6,738,415,616 parameters (6,738,415,616 trainable); activation model: transformers LlamaForCausalLM" in text
    assert "deepspeed ZeRO-3, 16 GPUs (2 nodes x 8), bf16 mixed, adamw" in text
    assert "Per GPU at the peak (steady step, backward)" in text
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("category"))
    assert header.split() == ["category", "GiB"]
    assert next(line for line in lines if line.startswith("peak")).split() == ["peak", "15.00"]
    assert next(line for line in lines if line.startswith("optimizer states")).split()[-1] == "4.00"
    assert "CPU RAM 10.00 GiB (pinned 4.00 GiB), NVMe 0.00 GiB" in text
    assert "Fits in 80.00 GiB per GPU: yes, 65.00 GiB to spare" in text
    assert "- reduce bucket at DeepSpeed's default 5e8 elements" in text


def test_per_phase_table_has_one_row_per_phase_and_marks_the_peak():
    text = render_estimate(estimate_to_dict(single_rank(ESTIMATE, TRAINING, 32), TRAINING))
    rows = [line for line in text.splitlines() if line.startswith(("first ", "steady "))]
    assert len(rows) == len(PHASES)
    peak_rows = [row for row in rows if row.endswith("<-")]
    assert len(peak_rows) == 1 and peak_rows[0].startswith("steady backward")
    # the marker's column is named (issue 21: it had an empty header over a row of dashes)
    header = next(line for line in text.splitlines() if line.startswith("step phase"))
    assert header.split()[-2:] == ["total", "peak"]
    # columns: step phase, 7 categories, total
    assert peak_rows[0].split()[2:11] == ["1.00", "1.00", "4.00", "5.00", "2.00", "1.00", "1.00", "15.00", "<-"]


def test_gb_means_ten_to_the_ninth_and_says_so():
    text = render_estimate(estimate_to_dict(single_rank(ESTIMATE, TRAINING, 32), TRAINING, gpu_memory_bytes=8 * GIB), units="GB")
    peak_line = next(line for line in text.splitlines() if line.startswith("peak"))
    assert peak_line.split() == ["peak", f"{15 * GIB / 1e9:.2f}"]  # 16.11, not 15.00
    assert "GiB" not in text
    assert f"Fits in {8 * GIB / 1e9:.2f} GB per GPU: no, {7 * GIB / 1e9:.2f} GB over" in text


def test_csv_is_the_per_phase_table_in_the_chosen_units():
    text = render_estimate(estimate_to_dict(single_rank(ESTIMATE, TRAINING, 32), TRAINING), output_format="csv", units="GB")
    rows = list(csv.DictReader(io.StringIO(text)))
    assert len(rows) == len(PHASES)
    assert list(rows[0]) == ["step", "phase", *(f"{key}_GB" for key in CATEGORY_LABELS), "total_GB", "is_peak"]
    peak = [row for row in rows if row["is_peak"] == "1"]
    assert [(row["step"], row["phase"]) for row in peak] == [("steady", "backward")]
    assert float(peak[0]["total_GB"]) == pytest.approx(15 * GIB / 1e9, abs=1e-4)


def test_markdown_uses_headings_and_pipe_tables():
    text = render_estimate(estimate_to_dict(single_rank(ESTIMATE, TRAINING, 32), TRAINING), output_format="markdown")
    assert "### Per GPU at the peak (steady step, backward)" in text
    peak_line = next(line for line in text.splitlines() if line.startswith("| peak"))
    assert [cell.strip() for cell in peak_line.strip("|").split("|")] == ["peak", "15.00"]


def test_json_rendering_round_trips():
    data = estimate_to_dict(single_rank(ESTIMATE, TRAINING, 32), TRAINING, gpu_memory_bytes=80 * GIB)
    assert json.loads(render_estimate(data, output_format="json")) == data


def test_model_rows_give_the_published_parameter_counts():
    from zeroplan.importers.catalog import params_model, resolve_model

    rows = {row["name"]: row for row in model_rows([resolve_model("llama-2-7b"), resolve_model("gpt2"), params_model(7_500_000_000)])}
    # Published totals: Llama-2-7b-hf 6,738,415,616; GPT-2 124,439,808 (issue 2, section 2).
    assert rows["llama-2-7b"]["params"] == 6_738_415_616
    assert rows["gpt2"]["params"] == 124_439_808
    assert rows["7,500,000,000 params"]["params"] == 7_500_000_000
    assert rows["7,500,000,000 params"]["layers"] is None
    table = render_models(list(rows.values()))
    assert "6,738,415,616" in table and "124,439,808" in table
    listed = json.loads(render_models(model_rows([resolve_model("llama-2-7b"), resolve_model("gpt2-xl"), resolve_model("gpt2")]), "json"))
    assert [(row["name"], row["params"]) for row in listed] == [  # by family, then size
        ("gpt2", 124_439_808), ("gpt2-xl", 1_557_611_200), ("llama-2-7b", 6_738_415_616)
    ]

"""One of each (issue 9): each idea written once, and every part that needs it reads that one.

A category list, a pydantic error formatter and a file reader, a configuration label, a
bytes-per-state table, and one "vary a spec" operation.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from zeroplan.errors import SpecError
from zeroplan.estimate.result import CATEGORY_NAMES, TENSOR_CATEGORIES, CategoryBytes
from zeroplan.spec.training import TrainingSpec
from zeroplan.spec.validation import describe_validation_error
from tests.paths import REPO

PACKAGE = REPO / "zeroplan"


# -- the category list ---------------------------------------------------------------------------
def test_the_category_list_is_the_result_type():
    assert CATEGORY_NAMES == CategoryBytes._fields
    assert TENSOR_CATEGORIES == tuple(name for name in CATEGORY_NAMES if name != "overhead")


def _category_lists(path: Path) -> list[int]:
    """Lines of `path` where a tuple, list or set literal names four or more categories."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            names = {item.value for item in node.elts if isinstance(item, ast.Constant)}
            if len(names & set(CATEGORY_NAMES)) >= 4:
                lines.append(node.lineno)
    return lines


def test_no_module_spells_the_category_list_again():
    copies = {str(path.relative_to(PACKAGE)): lines for path in sorted(PACKAGE.rglob("*.py"))
              if (lines := _category_lists(path))}
    assert copies == {}


def test_measure_reads_the_one_list():
    from zeroplan.measure.comparison import CATEGORIES as compared
    from zeroplan.measure.engines.common import ENGINE_CATEGORIES

    assert compared == TENSOR_CATEGORIES
    assert ENGINE_CATEGORIES == ("params", "grads", "optimizer_states", "buffers")  # issue 3: what a runner reports


# -- the pydantic error formatter ----------------------------------------------------------------
def _error(values: dict, model=TrainingSpec) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(values)
    return info.value


def test_formatter_suggests_the_closest_key():
    assert describe_validation_error(_error({"zero_stag": 3}), schema=TrainingSpec) == (
        "zero_stag: unknown key (did you mean zero_stage?)")
    nested = _error({"deepspeed": {"reduce_bucket": 1}})
    assert describe_validation_error(nested, "ds.json", TrainingSpec) == (
        "ds.json: deepspeed.reduce_bucket: unknown key (did you mean reduce_bucket_size?)")


def test_formatter_without_a_schema_still_names_the_key():
    assert describe_validation_error(_error({"zero_stag": 3})) == "zero_stag: unknown key"


def test_formatter_names_the_value_and_counts_the_problems():
    assert describe_validation_error(_error({"gpus": 0})) == "gpus: Input should be greater than or equal to 1 (got 0)"
    two = describe_validation_error(_error({"gpus": 0, "seq_len": "long"}), "cfg.py")
    assert two.startswith("2 errors in cfg.py: gpus: ")
    assert "seq_len: Input should be a valid integer, unable to parse string as an integer (got 'long')" in two
    assert describe_validation_error(_error({"gpus": 3, "gpus_per_node": 2})) == (
        "gpus 3 is not divisible by gpus_per_node 2")  # a rule across fields names them itself


def test_model_files_and_training_options_use_the_one_formatter(tmp_path):
    from zeroplan.importers.catalog import resolve_model
    from zeroplan.importers.options import training_spec_from_options

    path = tmp_path / "m.toml"
    path.write_text('name = "m"\nparams = 1000\nlargest_layer_param = 10\n')
    with pytest.raises(SpecError, match=r"m\.toml: largest_layer_param: unknown key \(did you mean largest_layer_params\?\)$"):
        resolve_model(str(path))
    with pytest.raises(SpecError, match=r"^micro_batch: Input should be greater than or equal to 1 \(got 0\)$"):
        training_spec_from_options({"micro_batch": 0})


def test_one_wording_for_malformed_json(tmp_path):
    from zeroplan.importers.catalog import resolve_model
    from zeroplan.importers.training_config import read_training_config

    messages = []
    for name, reader in (("model.json", resolve_model), ("ds.json", read_training_config)):
        path = tmp_path / name
        path.write_text('{\n  "a": 1\n]\n')  # a bracket that closes nothing (DeepSpeed's hjson allows a trailing comma)
        with pytest.raises(SpecError) as info:
            reader(str(path))
        messages.append(str(info.value).replace(name, "FILE"))
    assert messages[0].endswith(": invalid JSON: Expecting ',' delimiter (at line 3, column 1)")
    assert messages[1].startswith(messages[0])  # (and a hint to install hjson where it is missing)


# -- the label of a configuration ----------------------------------------------------------------
def test_compare_and_plan_name_a_configuration_alike():
    from zeroplan.importers.catalog import resolve_model
    from zeroplan.plan.grid import compare
    from zeroplan.plan.search import Choice
    from zeroplan.spec.training import Checkpointing, Offload, config_label

    model = resolve_model("llama-2-7b")
    rows = compare(model, TrainingSpec(gpus=8, zero_stage=3), stages=(3,), offloads=("cpu", "cpu-optimizer")).rows
    compared = {(row.training.offload_optimizer, row.training.offload_params): row.label for row in rows}
    for (optimizer, params), label in compared.items():
        assert Choice(3, optimizer, params, Checkpointing.NONE, 8).label() == label
    assert compared == {(Offload.CPU, Offload.CPU): "ZeRO-3 + opt->cpu + params->cpu", (Offload.CPU, Offload.NONE): "ZeRO-3 + opt->cpu"}
    assert config_label(1, checkpointing=Checkpointing.FULL) == "ZeRO-1 + ckpt full"


def test_compare_and_plan_print_the_same_label(tmp_path):
    from click.testing import CliRunner

    from zeroplan.cli import cli

    common = ["llama-2-7b", "--gpus", "8", "--gpu", "h100-80gb", "--format", "json"]
    compared = json.loads(CliRunner().invoke(cli, ["compare", *common, "--zero", "3", "--offload", "cpu"]).output)
    planned = json.loads(CliRunner().invoke(cli, ["plan", *common, "--zero", "3", "--offload", "cpu",
                                                   "--checkpointing", "none", "--top", "10"]).output)
    compare_labels = {row["config"] for row in compared["rows"]}
    plan_labels = {row["config"] for row in planned["top"]}
    assert "ZeRO-3 + opt->cpu + params->cpu" in compare_labels & plan_labels


# -- varying a spec ------------------------------------------------------------------------------
def test_a_varied_spec_is_validated_and_keeps_the_rest():
    base = TrainingSpec(gpus=16, gpus_per_node=8, seq_len=4096, deepspeed={"reduce_bucket_size": 10})
    varied = base.varied(zero_stage=3, gpus=4)
    assert (varied.zero_stage, varied.gpus, varied.gpus_per_node, varied.seq_len) == (3, 4, 4, 4096)  # a world below a node is that node
    assert varied.deepspeed is base.deepspeed  # shared, not copied: the estimator's caches key on the knob models
    with pytest.raises(SpecError, match=r"^offload_params requires zero_stage 3 \(got zero_stage 2\)$"):
        base.varied(zero_stage=2, offload_params="cpu")
    with pytest.raises(SpecError, match=r"^zero_stag: unknown key \(did you mean zero_stage\?\)$"):
        base.varied(zero_stag=2)


def test_compare_and_plan_skip_an_invalid_combination_for_the_same_reason():
    from zeroplan.importers.catalog import resolve_model
    from zeroplan.plan.grid import compare
    from zeroplan.importers.gpus import get_gpu
    from zeroplan.plan.rates import rates_for
    from zeroplan.plan.search import Choice, Planner
    from zeroplan.spec.training import Checkpointing, Offload

    model = resolve_model("llama-2-7b")
    base = TrainingSpec(gpus=8, zero_stage=1)
    reason = "offload_optimizer requires zero_stage 1 or higher (ZeRO-Offload partitions the states)"
    assert f"skipped ZeRO-0 offload cpu on 8 GPUs: {reason}" in compare(model, base, stages=(0, 1), offloads=("cpu",)).skipped
    planner = Planner(model, base, rates_for(get_gpu("h100-80gb")))
    assert planner.refused(Choice(0, Offload.CPU, Offload.NONE, Checkpointing.NONE, 8)) == ("ZeRO-0 + opt->cpu on 8 GPUs", reason)


# -- the bytes-per-state table -------------------------------------------------------------------
@pytest.mark.parametrize("precision, optimizer, touched", [
    # read+write the updated weight and each state, read the gradient, write the 16-bit copy
    ("bf16", "adamw", 2 * 4 + 2 * 8 + 4 + 2),  # ZeRO paper 3.1: fp32 master, two fp32 moments
    ("fp16", "sgd", 2 * 4 + 2 * 4 + 4 + 2),
    ("fp32", "adamw", 2 * 4 + 2 * 8 + 4),
    ("pure-bf16", "adam", 2 * 2 + 2 * 4 + 2),
    ("bf16", "adam8bit", 2 * 4 + 2 * 2 * (1 + 4 / 256) + 4 + 2),  # bitsandbytes: uint8 states + an fp32 absmax per 256
    ("pure-bf16", "adam32bit", 2 * 2 + 2 * 8 + 2),  # bitsandbytes' 32-bit states are fp32 whatever the parameters
])
def test_the_step_cost_reads_the_estimators_bytes_per_state(precision, optimizer, touched):
    from zeroplan.estimate.dtypes import state_bytes
    from zeroplan.plan.step_time import optimizer_bytes_per_param
    from zeroplan.spec.training import Optimizer, Precision

    assert optimizer_bytes_per_param(state_bytes(Precision(precision), Optimizer(optimizer))) == touched


def test_the_step_cost_keeps_no_table_of_its_own():
    tree = ast.parse((PACKAGE / "plan" / "step_time.py").read_text())
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert not names & {"Optimizer", "Precision"}  # what a state weighs comes from estimate.dtypes


# -- the library names fields, the command line names options ------------------------------------
def _raised_texts(path: Path) -> list[str]:
    """The string pieces of every `raise` in `path`."""
    texts = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Raise) and node.exc is not None:
            texts += [part.value for part in ast.walk(node.exc) if isinstance(part, ast.Constant) and isinstance(part.value, str)]
    return texts


def test_the_planner_names_no_option_in_its_errors():
    flagged = {str(path.relative_to(PACKAGE)): [text for text in _raised_texts(path) if "--" in text]
               for path in sorted((PACKAGE / "plan").rglob("*.py"))}
    assert {path: texts for path, texts in flagged.items() if texts} == {}


def test_library_fields_are_named_by_their_options_on_the_command_line():
    from zeroplan.errors import FieldError
    from zeroplan.plan.search import Limits, parse_gpu_counts

    with pytest.raises(FieldError, match=r"^headroom: must be in \[0, 1\), got 1$") as info:
        Limits(gpu_memory_bytes=1, headroom=1)
    from zeroplan.cli.common import user_message

    assert user_message(info.value) == "--headroom: must be in [0, 1), got 1"
    with pytest.raises(FieldError) as info:
        parse_gpu_counts("eight")
    assert user_message(info.value) == "--gpus: cannot read 'eight'; write 8, 8,16,64 or a range 8-64 (doubling)"


@pytest.mark.parametrize("args, message", [
    (["--gpus", "8", "--global-batch", "12"], "Error: --global-batch: 12 is not divisible by the GPU count (8)"),
    (["--gpus", "8-x"], "Error: --gpus: cannot read '8-x'; write 8, 8,16,64 or a range 8-64 (doubling)"),
])
def test_plan_errors_name_the_option(args, message):
    from click.testing import CliRunner

    from zeroplan.cli import cli

    result = CliRunner().invoke(cli, ["plan", "llama-2-7b", "--gpu", "h100-80gb", *args])
    assert result.exit_code == 2
    assert result.output.strip() == message


# -- commands hold no decisions ------------------------------------------------------------------
def test_the_cost_assumptions_are_made_by_the_library():
    from zeroplan.importers.gpus import get_gpu
    from zeroplan.plan.rates import DEFAULT_SPEEDS_GPU, gpu_speeds, rates_for

    default = get_gpu(DEFAULT_SPEEDS_GPU)
    assumed = rates_for(None, gpu_tflops=100.0, pcie_gbps=32.0, max_efficiency=None)
    assert assumed.gpu_flops_per_s == 100e12 and assumed.pcie_bytes_per_s == 32e9  # TFLOP/s and GB/s, as typed
    assert assumed.hbm_bytes_per_s == default.hbm_bytes_per_s  # None: not given
    assert assumed.step_efficiency == gpu_speeds(DEFAULT_SPEEDS_GPU).step_mfu
    assert assumed.source.startswith(f"no --gpu given: speeds of {default.label} assumed")


def test_the_measure_backend_and_device_are_chosen_by_the_library():
    from zeroplan.errors import MeasureError
    from zeroplan.measure.launcher import choose_backend, measured_device
    from zeroplan.spec.training import Device

    assert choose_backend(None, simulate=True) == "fake"
    assert choose_backend("gloo") == "gloo"
    assert choose_backend(None) in ("gloo", "nccl")
    with pytest.raises(MeasureError, match="runs the fake backend, not nccl"):
        choose_backend("nccl", simulate=True)
    assert [measured_device(backend) for backend in ("nccl", "gloo", "fake")] == [Device.CUDA, Device.CPU, Device.CPU]

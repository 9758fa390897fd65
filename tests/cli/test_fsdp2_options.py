"""The FSDP2 wrapping knobs (TrainingSpec.fsdp2) as options of estimate, compare, plan and measure."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli

FSDP2 = ["--engine", "fsdp2", "--zero", "3", "--gpus", "4"]


def _wrapping(*options: str) -> dict:
    result = CliRunner().invoke(cli, ["estimate", "tiny-llama", *FSDP2, "--format", "json", *options])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["program"]["fsdp2"]


def test_the_options_set_the_wrapping():
    assert _wrapping() == {"units": "split", "reshard_root": True, "reshard_head": False, "reshard_last_block": True}
    assert _wrapping("--fsdp2-units", "root", "--no-fsdp2-reshard-root") == {
        "units": "root", "reshard_root": False, "reshard_head": False, "reshard_last_block": True}
    assert _wrapping("--fsdp2-reshard-head", "--no-fsdp2-reshard-last-block") == {
        "units": "split", "reshard_root": True, "reshard_head": True, "reshard_last_block": False}


def test_an_option_wins_over_the_config_file_s_recipe(tmp_path):
    # torchtune's recipe: FSDP2 with the outer modules in the root unit
    yaml = tmp_path / "tune.yaml"
    yaml.write_text("model:\n  _component_: torchtune.models.llama3_2.llama3_2_1b\nbatch_size: 2\n"
                    "loss:\n  _component_: torchtune.modules.loss.CEWithChunkedOutputLoss\n"
                    "optimizer:\n  _component_: torch.optim.AdamW\n")
    for given, units in (([], "root"), (["--fsdp2-units", "split"], "split")):
        result = CliRunner().invoke(cli, ["estimate", "--config", str(yaml), "--gpus", "4", *given, "--format", "json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["program"]["fsdp2"]["units"] == units


@pytest.mark.parametrize("command, options, message", [
    ("estimate", [*FSDP2, "--fsdp2-units", "split", "--fsdp2-reshard-root"], r"^Error: fsdp2.reshard_root_after_forward: "),
    ("estimate", [*FSDP2, "--fsdp2-units", "root", "--fsdp2-reshard-head"], r"^Error: fsdp2.reshard_head_after_forward "),
    ("estimate", ["--engine", "fsdp2", "--zero", "2", "--fsdp2-reshard-last-block"], r"^Error: fsdp2.reshard_last_block: "),
    ("estimate", ["--engine", "deepspeed", "--zero", "3", "--fsdp2-units", "root"], r"^Error: fsdp2.units, .* not deepspeed"),
    ("compare", ["--engine", "fsdp2", "--zero", "2", "--fsdp2-reshard-last-block"], r"^Error: fsdp2.reshard_last_block: "),
    ("measure", ["--engine", "deepspeed", "--zero", "3", "--nproc", "2", "--fsdp2-units", "split"], r"^Error: fsdp2.units"),
    ("estimate", [*FSDP2, "--fsdp2-units", "both"], r"^Error: Invalid value for '--fsdp2-units'"),
])
def test_a_knob_that_does_not_apply_is_one_line(command, options, message):
    if command == "measure":
        pytest.importorskip("torch")  # without it, measure says first that it needs torch
    result = CliRunner().invoke(cli, [command, "tiny-llama", *options])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert re.match(message, lines[0]), lines[0]


def test_plan_searches_with_the_wrapping_given():
    result = CliRunner().invoke(cli, ["plan", "tiny-llama", "--engine", "fsdp2", "--gpus", "4", "--gpu-memory", "1GiB",
                                      "--fsdp2-units", "root", "--format", "json"])
    assert result.exit_code == 0, result.output

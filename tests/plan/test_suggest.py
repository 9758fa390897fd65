"""When nothing fits, `plan` (with or without --mesh) and `estimate` (with --gpu or --gpu-memory) say the smallest
change that would, each change checked by an estimate (zeroplan/plan/suggest.py); the exit status stays 0."""

from __future__ import annotations

import json

from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.estimate import fit
from zeroplan.importers.catalog import resolve_model
from zeroplan.importers.options import training_spec_from_options
from zeroplan.plan.suggest import suggest_changes
from zeroplan.spec.training import TrainingSpec

GIB = 2**30


def _options(change: str) -> dict:
    words = change.split()
    return {flag.removeprefix("--").replace("-", "_"): value for flag, value in zip(words[::2], words[1::2])}


def test_each_suggested_change_fits_and_a_single_change_is_the_weakest_that_does():
    model = resolve_model("llama-2-7b")
    training = TrainingSpec(gpus=8, zero_stage=1, micro_batch=8, seq_len=4096)
    budget = 40 * GIB
    assert fit(model, training).peak_bytes > budget
    found = suggest_changes(model, training, budget)
    assert found
    for suggestion in found:
        fields = {"gpus": 8, "zero_stage": 1, "micro_batch": 8, "seq_len": 4096, **_options(suggestion.change)}
        if "zero" in fields:
            fields["zero_stage"] = fields.pop("zero")
        changed = training_spec_from_options(fields, None, model)
        assert fit(model, changed).peak_bytes == suggestion.peak_bytes <= budget
    micro = next(s for s in found if s.change.startswith("--micro-batch"))
    smaller = int(micro.change.split()[1])
    # the largest micro-batch that fits, halving: twice it does not (same sequences per step)
    bigger = training.varied(micro_batch=2 * smaller, grad_accum=training.micro_batch // (2 * smaller))
    assert 2 * smaller == training.micro_batch or fit(model, bigger).peak_bytes > budget


def test_kinds_are_combined_when_no_single_change_fits():
    found = suggest_changes(resolve_model("llama-3-70b"), TrainingSpec(gpus=1), 24 * GIB)
    assert found and all(" + " in s.what for s in found)
    assert all(s.peak_bytes <= 24 * GIB for s in found)


def test_estimate_prints_and_writes_the_suggestions_and_exits_0():
    runner = CliRunner()
    args = ["estimate", "llama-3-70b", "--gpus", "8", "--gpu", "h100-80gb", "--micro-batch", "4"]
    table = runner.invoke(cli, args)
    assert table.exit_code == 0, table.output
    assert "Smallest changes that would fit:" in table.output and "  - " in table.output
    data = json.loads(runner.invoke(cli, [*args, "--format", "json"]).stdout)
    assert data["fits"] is False and data["suggestions"]
    assert all({"change", "what", "peak"} <= set(s) for s in data["suggestions"])
    memory_only = runner.invoke(cli, ["estimate", "llama-3-70b", "--gpus", "8", "--gpu-memory", "80GiB", "--format", "json"])
    assert json.loads(memory_only.stdout)["suggestions"] and "step" not in json.loads(memory_only.stdout)
    fitting = json.loads(runner.invoke(cli, ["estimate", "gpt2", "--gpus", "1", "--gpu", "h100-80gb", "--format",
                                             "json"]).stdout)
    assert fitting["fits"] and "suggestions" not in fitting


def test_a_mesh_plan_where_nothing_fits_says_what_would():
    result = CliRunner().invoke(cli, ["plan", "llama-3-70b", "--gpu", "h100-80gb", "--gpus", "8", "--mesh", "--engine",
                                      "fsdp2", "--offload", "none", "--max-micro-batch", "4"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "nothing fits. Smallest changes that would:" in lines
    assert any(line.startswith("  - use ") or line.startswith("  - allow ") for line in lines)

"""zeroplan compare: the grid, its savings against ZeRO-0, the skipped combinations, the formats and
the picture."""

from __future__ import annotations

import csv
import io
import json
import sys

import pytest
from click.testing import CliRunner

from zeroplan.importers.catalog import resolve_model
from zeroplan.plan.grid import compare
from zeroplan.errors import MissingDependencyError, SpecError
from zeroplan.estimate import estimate
from zeroplan.estimate.serialize import estimate_to_dict, single_rank
from zeroplan.report.compare import render_comparison
from zeroplan.spec.model import ParamCountSpec
from zeroplan.spec.training import Offload, TrainingSpec

GIB = 2**30


def _cli():
    # The real group: click caches a command's help option the first time it is built, so a
    # test-only group without -h would leave `compare -h` broken for later tests.
    from zeroplan.cli import cli

    return cli


def test_zero_paper_table_1_as_a_comparison():
    """ZeRO paper (Rajbhandari et al. 2020) Table 1, Ψ = 7.5B, K = 12, N = 64: 120 GB baseline,
    31.4 GB with P_os, 16.6 GB with P_os+g, 1.88 GB with P_os+g+p."""
    model = ParamCountSpec(params=7_500_000_000)
    comparison = compare(model, TrainingSpec(engine="paper", gpus=64, precision="fp16"), gpu_counts=(64,))
    peaks_gb = [row.estimate.peak_bytes / 1e9 for row in comparison.rows]
    assert peaks_gb == pytest.approx([120.0, 31.4, 16.6, 1.88], abs=0.05)  # the paper rounds to 0.1 GB
    assert [round(row.saving_percent, 1) for row in comparison.rows] == [0.0, 73.8, 86.1, 98.4]


def test_grid_rows_are_the_estimates_of_their_configs():
    model = resolve_model("llama-2-7b")
    comparison = compare(model, TrainingSpec(), gpu_counts=(8, 64), offloads=("none", "cpu", "cpu-optimizer"),
                         gpu_memory_bytes=80 * GIB, headroom=0.05)
    labels = [(row.label, row.training.gpus) for row in comparison.rows]
    assert labels[:7] == [
        ("ZeRO-0", 8), ("ZeRO-1", 8), ("ZeRO-1 + opt->cpu", 8), ("ZeRO-2", 8), ("ZeRO-2 + opt->cpu", 8), ("ZeRO-3", 8),
        ("ZeRO-3 + opt->cpu + params->cpu", 8),
    ]
    assert labels[7] == ("ZeRO-3 + opt->cpu", 8)  # cpu-optimizer differs from cpu only at stage 3
    assert len(labels) == 16
    for row in comparison.rows:
        assert row.estimate == estimate(model, row.training)
        baseline = estimate(model, row.training.model_copy(update={
            "zero_stage": 0, "offload_optimizer": Offload.NONE, "offload_params": Offload.NONE}))
        assert row.saving_percent == pytest.approx(100 * (1 - row.estimate.peak_bytes / baseline.peak_bytes))
        assert row.fits == (row.estimate.peak_bytes <= int(80 * GIB * 0.95))
    # offload at stage 0 is not a configuration DeepSpeed can run: skipped, with the reason
    assert any("ZeRO-0 offload cpu on 8 GPUs: offload_optimizer requires zero_stage 1" in note for note in comparison.skipped)


def test_nvme_and_engine_limits_are_skipped_with_reasons():
    model = resolve_model("gpt2")
    comparison = compare(model, TrainingSpec(engine="torch"), stages=(0, 1, 2, 3), gpu_counts=(2,))
    assert [row.training.zero_stage for row in comparison.rows] == [0, 1]
    assert any("engine torch covers zero_stage 0" in note for note in comparison.skipped)
    comparison = compare(model, TrainingSpec(), stages=(2, 3), gpu_counts=(2,), offloads=("nvme",))
    assert [row.label for row in comparison.rows] == ["ZeRO-3 + opt->nvme + params->nvme"]
    assert any("offload_optimizer nvme requires zero_stage 3" in note for note in comparison.skipped)


def test_bad_grid_values():
    model = resolve_model("gpt2")
    with pytest.raises(SpecError, match="^offloads: unknown choice 'disk'"):
        compare(model, TrainingSpec(), offloads=("disk",))
    with pytest.raises(SpecError, match="^stages: stage must be 0, 1, 2 or 3, got 4"):
        compare(model, TrainingSpec(), stages=(4,))


def test_formats_carry_the_same_bytes():
    model = resolve_model("gpt2")
    comparison = compare(model, TrainingSpec(seq_len=1024), gpu_counts=(2,), gpu_memory_bytes=24 * GIB)
    data = json.loads(render_comparison(comparison, "json"))
    assert [row["per_gpu"]["peak"] for row in data["rows"]] == [row.estimate.peak_bytes for row in comparison.rows]
    for row in data["rows"]:
        parts = sum(row["per_gpu"][key] for key in ("params", "grads", "optimizer_states", "activations", "buffers",
                                                    "temporaries", "overhead"))
        assert parts == row["per_gpu"]["peak"]
    # each row's per_gpu and per_node have the shapes of `zeroplan estimate --format json`
    for row, original in zip(data["rows"], comparison.rows):
        single = estimate_to_dict(single_rank(original.estimate, original.training, model.num_layers), original.training)
        assert (row["per_gpu"], row["per_node"]) == (single["per_gpu"], single["per_node"])
    table = list(csv.DictReader(io.StringIO(render_comparison(comparison, "csv"))))
    assert [int(row["peak_bytes"]) for row in table] == [row.estimate.peak_bytes for row in comparison.rows]
    assert [(row["peak_step"], row["peak_phase"]) for row in table] == [
        (row.estimate.peak.step.value, row.estimate.peak.phase.value) for row in comparison.rows]
    markdown = render_comparison(comparison, "markdown", "GB")
    assert "| config" in markdown and "peak (GB)" in markdown
    text = render_comparison(comparison, "table")
    assert "peak (GiB)" in text and "2^30 bytes" in text


def test_cli_compare(tmp_path):
    runner = CliRunner()
    result = runner.invoke(_cli(), ["compare", "llama-2-7b", "--zero", "0,3", "--gpus", "8,64", "--offload", "none,cpu",
                                    "--gpu", "h100-80gb", "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["gpu_memory"] == 85_899_345_920  # h100-80gb: 80 GiB
    assert [(row["config"], row["gpus"]) for row in data["rows"]] == [
        ("ZeRO-0", 8), ("ZeRO-3", 8), ("ZeRO-3 + opt->cpu + params->cpu", 8),
        ("ZeRO-0", 64), ("ZeRO-3", 64), ("ZeRO-3 + opt->cpu + params->cpu", 64),
    ]
    result = runner.invoke(_cli(), ["compare", "gpt2", "--zero", "0,5"])
    assert result.exit_code == 2
    assert "Error: --zero: 5 is out of range (0-3)" in result.output
    result = runner.invoke(_cli(), ["compare", "gpt2", "--offload", "ram"])
    assert result.exit_code == 2
    assert "Error: --offload: unknown choice 'ram'; use none, cpu, nvme, cpu-optimizer, nvme-optimizer" in result.output


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "zero.png"
    result = CliRunner().invoke(_cli(), ["compare", "gpt2", "--gpus", "2", "--offload", "none,cpu", "--gpu-memory", "2GiB",
                                         "--plot", str(path)])
    assert result.exit_code == 0, result.output
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    from zeroplan.report.plot import plot_comparison

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    comparison = compare(resolve_model("gpt2"), TrainingSpec(), gpu_counts=(2,), stages=(0,))
    with pytest.raises(MissingDependencyError, match=r"pip install 'zeroplan\[plot\]'"):
        plot_comparison(comparison, tmp_path / "x.png")


def test_fsdp2_is_compared_with_ddp():
    """FSDP2 has no stage 0; its savings are against DDP (engine torch, stage 0) on the same GPUs."""
    model = resolve_model("gpt2")
    result = CliRunner().invoke(_cli(), ["compare", "gpt2", "--engine", "fsdp2", "--zero", "2,3", "--gpus", "4",
                                         "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    ddp = estimate(model, TrainingSpec(engine="torch", zero_stage=0, gpus=4))
    for row in data["rows"]:
        assert row["saving_vs_stage0_percent"] == round(100 * (1 - row["per_gpu"]["peak"] / ddp.peak_bytes), 2)
    assert "baseline on 4 GPUs: DDP (engine torch, stage 0), as fsdp2 has no stage 0" in data["skipped"]

"""Issue 10: each bad or odd input a new user tried, reproduced, with the one-line answer it now gets.

Every case runs the real command through click's CliRunner: exit status 2, one line on stderr
naming the option or field, no traceback, and nothing written.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


BAD = {
    # numbers: OverflowError tracebacks before
    "size of 1e400": (["estimate", "llama-2-7b", "--gpu-memory", "1e400"], r"'--gpu-memory': size '1e400' is larger than 1 EiB"),
    "count of 1e400": (["estimate", "--params", "1e400"], r"'--params': '1e400' is more than 10\^15"),
    # nan switched the timeout off; inf became a cost model of infinite speed
    "timeout nan": (["measure", "tiny-llama", "--nproc", "1", "--timeout", "nan"], r"'--timeout': 'nan' is not a finite number"),
    "tflops inf": (["plan", "llama-2-7b", "--gpu", "h100-80gb", "--gpu-tflops", "inf"], r"'--gpu-tflops': 'inf' is not a finite number"),
    "headroom nan": (["compare", "llama-2-7b", "--headroom", "nan"], r"'--headroom': 'nan' is not a finite number"),
    "efficiency -inf": (["plan", "llama-2-7b", "--gpu", "h100-80gb", "--max-efficiency", "-inf"], r"'--max-efficiency'"),
    # lists: an empty item was skipped, a repeated one counted twice
    # compare reads --gpus with plan's parser (issue 21: it refused ranges)
    "empty list item": (["compare", "llama-2-7b", "--gpus", "8,,16"], r"--gpus: cannot read '8,,16'; write 8, 8,16,64 or a range"),
    "repeated GPU count": (["compare", "llama-2-7b", "--gpus", "8,8"], r"--gpus: a count is listed more than once in '8,8'"),
    "repeated stage": (["compare", "llama-2-7b", "--zero", "3,3"], r"--zero: 3 listed more than once"),
    "repeated offload": (["plan", "llama-2-7b", "--gpu", "h100-80gb", "--offload", "cpu,cpu"], r"--offload: cpu listed more than once"),
    "repeated plan GPUs": (["plan", "llama-2-7b", "--gpu", "h100-80gb", "--gpus", "8,16,8"], r"--gpus: a count is listed more than once"),
    "too many GPUs": (["plan", "llama-2-7b", "--gpu", "h100-80gb", "--gpus", "8-100000000"], r"--gpus: at most 1,048,576 GPUs"),
    "unbounded micro-batch": (["plan", "llama-2-7b", "--gpu", "h100-80gb", "--max-micro-batch", "100000000"],
                              r"'--max-micro-batch': 100000000 is not in the range 1<=x<=65536"),
    # two options naming the same thing: the last one won silently
    "--gpu with --gpu-memory": (["compare", "llama-2-7b", "--gpu", "h100-80gb", "--gpu-memory", "40GiB"],
                                r"--gpu and --gpu-memory both give the GPU's memory; give one of them"),
    # an empty table with exit 0
    "every combination skipped": (["compare", "llama-2-7b", "--zero", "0", "--offload", "cpu"],
                                  r"nothing to compare: every combination was skipped \(skipped ZeRO-0 offload cpu on 8 GPUs"),
    # 45 GiB instead of 5.4 GiB: the whole model taken as one gathered layer
    "--params at ZeRO-3 without --largest-layer": (["estimate", "--params", "7.5e9", "--gpus", "64", "--zero", "3"],
                                                  r"largest_layer_params: .* \(--largest-layer\) under DeepSpeed ZeRO-3"),
    "--params under FSDP2 without --largest-layer": (["estimate", "--params", "7.5e9", "--engine", "fsdp2", "--zero", "2", "--gpus", "8"],
                                                    r"largest_layer_params: .* under FSDP2"),
    # advice that misled: nothing fits, and --nvme never named
    "--offload nvme without --nvme": (["plan", "llama-2-7b", "--gpu", "h100-80gb", "--offload", "nvme"], r"--offload nvme needs --nvme SIZE"),
    # refused only after the workers had started
    "measure --engine paper": (["measure", "tiny-llama", "--engine", "paper", "--nproc", "1"], r"engine: paper is the ZeRO paper's accounting"),
}


NEEDS_TORCH = {"measure --engine paper"}  # measure checks for torch before it builds the spec


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_gets_one_line_and_exit_2(case):
    args, message = BAD[case]
    if case in NEEDS_TORCH and importlib.util.find_spec("torch") is None:
        pytest.skip("zeroplan measure needs torch")
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    error_lines = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(error_lines) == 1, result.output
    assert re.search(message, error_lines[0]), error_lines[0]


@pytest.mark.parametrize("command", [
    ["plan", "llama-2-7b", "--gpu", "h100-80gb", "--gpus", "8", "--emit", "deepspeed"],
    ["compare", "llama-2-7b", "--zero", "3", "--plot"],
    ["measure", "tiny-llama", "--nproc", "1", "--output"],
])
@pytest.mark.parametrize("where", ["missing directory", "directory as the file", "read-only directory"])
def test_output_paths_are_checked_before_the_work(tmp_path, command, where):
    option = command[-2] if command[-2] == "--emit" else command[-1]
    if where == "missing directory":
        target, expected = tmp_path / "no" / "out.file", "does not exist; create it first"
    elif where == "directory as the file":
        target, expected = tmp_path, "is a directory"
    else:
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o500)
        target, expected = folder / "out.file", "is not writable"
        if os.access(folder, os.W_OK):  # root ignores permissions
            pytest.skip("running as root: a read-only directory is still writable")
    result = run(*command, str(target))
    assert result.exit_code == 2, result.output
    assert option in result.output.splitlines()[0] and expected in result.output
    # the check comes first: no table was printed, nothing was written
    assert "peak" not in result.output and "config" not in result.output
    assert not (tmp_path / "no").exists()


def test_emit_is_written_whole(tmp_path):
    target = tmp_path / "ds.json"
    result = run("plan", "llama-2-7b", "--gpu", "h100-80gb", "--gpus", "8", "--emit", "deepspeed", str(target))
    assert result.exit_code == 0, result.output
    assert json.loads(target.read_text())["zero_optimization"]["stage"] in (0, 1, 2, 3)
    assert [p.name for p in tmp_path.iterdir()] == ["ds.json"]  # no temporary file left behind


def test_plan_searches_only_what_the_engine_runs():
    """fsdp2 has no stage 0-1 and offloads parameters with the optimizer; torch does not offload.
    The planner used to generate those combinations and then tell the user to set an option."""
    for engine in ("fsdp2", "torch"):
        result = run("plan", "llama-2-7b", "--gpu", "h100-80gb", "--gpus", "8", "--engine", engine)
        assert result.exit_code == 0, result.output
        assert "skipped" not in result.output, result.output
    fsdp2 = run("plan", "llama-2-7b", "--gpu", "h100-80gb", "--gpus", "8", "--engine", "fsdp2", "--top", "50").output
    assert "ZeRO-3 + opt->cpu + params->cpu" in fsdp2 and "ZeRO-3 + opt->cpu" not in fsdp2.replace("opt->cpu + params", "")


def test_fsdp2_offload_of_the_optimizer_alone_says_the_parameters_go_too():
    result = run("estimate", "llama-2-7b", "--engine", "fsdp2", "--zero", "3", "--gpus", "8", "--offload-optimizer", "cpu")
    assert result.exit_code == 0
    assert "CPUOffloadPolicy keeps the parameter and gradient shards on the host" in result.output


def test_params_with_largest_layer_matches_deepspeed_s_own_formula():
    # DeepSpeed estimate_zero3_model_states_mem_needs: largest layer x 4 bytes (fp32 gather) is what
    # the layer term adds; 5.4 GiB with a 2e8-element layer, not the 45 GiB of one 7.5e9 layer.
    result = run("estimate", "--params", "7.5e9", "--largest-layer", "2e8", "--gpus", "64", "--zero", "3", "--format", "json")
    assert result.exit_code == 0
    assert json.loads(result.output)["per_gpu"]["peak"] < 6 * 2**30

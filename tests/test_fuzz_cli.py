"""Property-based fuzzing of the command line (issue 10): random option values for estimate, compare
and plan never produce a traceback, end with status 0 or 2 only, and with 2 print exactly one
`Error:` line. Each call is bounded (the planner's searches are capped), and the whole test runs in
seconds. Config documents are fuzzed in tests/test_fuzz_config.py.
"""

from __future__ import annotations

from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeroplan.cli import cli

# What users type: good values, near misses, and junk (numbers out of range, nan, inf, 1e400,
# empty and repeated list items, unknown names).
NUMBERS = st.sampled_from(["1", "2", "8", "0", "-1", "1.5", "nan", "inf", "-inf", "1e400", "1e9", "", " ", "x", "7B", "8,8", "8,,16"])
SIZES = st.sampled_from(["80GiB", "40GB", "1e400", "0", "-5GB", "nan", "24e9", "h100-80gb", "rtx4090-24gb", "nope", "1 PiB"])
MODELS = st.sampled_from(["tiny-llama", "gpt2", "llama-2-7b", "TINY-LLAMA", "no-such-model", ".", "/nonexistent/config.json"])
ENUMS = {
    "--engine": ["deepspeed", "fsdp2", "torch", "paper", "megatron"],
    "--precision": ["fp32", "bf16", "fp16", "pure-bf16", "int3"],
    "--offload-optimizer": ["none", "cpu", "nvme", "gpu"],
    "--offload-params": ["none", "cpu", "nvme"],
    "--checkpointing": ["none", "selective", "full", "some"],
    "--attention": ["eager", "fused", "flash"],
    "--device": ["cuda", "cpu", "tpu"],
    "--optimizer": ["adamw", "adam", "sgd", "adam8bit", "lion"],
    "--units": ["GiB", "GB", "MiB", "MB", "KiB"],
    "--format": ["table", "json", "csv", "markdown", "xml"],
}
COUNT_OPTIONS = ["--gpus", "--zero", "--micro-batch", "--seq-len", "--grad-accum", "--gpus-per-node"]


@st.composite
def estimate_args(draw):
    args = ["estimate", draw(MODELS)]
    for option in draw(st.lists(st.sampled_from(COUNT_OPTIONS), max_size=3, unique=True)):
        args += [option, draw(NUMBERS)]
    for option in draw(st.lists(st.sampled_from(sorted(ENUMS)), max_size=4, unique=True)):
        args += [option, draw(st.sampled_from(ENUMS[option]))]
    if draw(st.booleans()):
        args += ["--gpu-memory", draw(SIZES)]
    return args


@st.composite
def grid_args(draw):
    command = draw(st.sampled_from(["compare", "plan"]))
    args = [command, draw(MODELS)]
    lists = {"--zero": ["0,1,2,3", "3", "3,3", "", "0,,1", "4", "x"], "--gpus": ["8", "8,64", "8-64", "8,8", "0", "8-1", "1e400"],
             "--offload": ["none", "none,cpu", "nvme", "cpu,cpu", "gpu"]}
    for option in draw(st.lists(st.sampled_from(sorted(lists)), max_size=3, unique=True)):
        args += [option, draw(st.sampled_from(lists[option]))]
    for option in draw(st.lists(st.sampled_from(["--engine", "--precision", "--units", "--format"]), max_size=2, unique=True)):
        args += [option, draw(st.sampled_from(ENUMS[option]))]
    memory = draw(st.sampled_from(["--gpu", "--gpu-memory", "both", "none"]))
    if memory in ("--gpu", "both"):
        args += ["--gpu", draw(st.sampled_from(["h100-80gb", "a100-40gb", "nope"]))]
    if memory in ("--gpu-memory", "both"):
        args += ["--gpu-memory", draw(SIZES)]
    if command == "plan" and draw(st.booleans()):
        args += ["--headroom", draw(st.sampled_from(["0.05", "nan", "1", "-0.1", "inf"]))]
    if command == "plan" and draw(st.booleans()):
        args += ["--max-micro-batch", draw(st.sampled_from(["1", "64", "100000000", "0"]))]
    return args


def check(args: list[str]) -> None:
    result = CliRunner().invoke(cli, args)
    # An exception escaping click is a traceback for the user; SystemExit carries the status.
    assert result.exception is None or isinstance(result.exception, SystemExit), (args, repr(result.exception))
    assert result.exit_code in (0, 2), (args, result.exit_code, result.output)
    assert "Traceback" not in result.output, (args, result.output)
    if result.exit_code == 2:
        assert sum(line.startswith("Error:") for line in result.output.splitlines()) == 1, (args, result.output)
    else:
        assert result.output.strip(), (args, "exit 0 with no output")


FUZZ = settings(max_examples=120, deadline=5000, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@FUZZ
@given(estimate_args())
def test_estimate_never_tracebacks(args):
    check(args)


@settings(FUZZ, max_examples=60)
@given(grid_args())
def test_compare_and_plan_never_traceback(args):
    check(args)

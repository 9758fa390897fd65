"""Property-based fuzzing of the command line (issue 10): random option values for estimate, compare
and plan never produce a traceback, end with status 0 or 2 only, and with 2 print exactly one
`Error:` line. Each call is bounded (the planner's searches are capped), and the whole test runs in
seconds. Config documents are fuzzed in tests/project/test_fuzz_config.py.
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


# ---------------------------------------------------------------- issue 21: the families a second newcomer found

import json  # noqa: E402
import os  # noqa: E402
import stat  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

COUNT_LIMITED = ["--gpus", "--micro-batch", "--seq-len", "--grad-accum", "--gpus-per-node", "--checkpoint-every",
                 "--tp", "--cp", "--pp", "--ep", "--dp-replicate", "--pp-virtual-stages", "--lora-rank"]
_huge = st.integers(15, 400).map(lambda digits: "9" * digits)  # 10^15 to a 400-digit number
_names = st.one_of(
    st.integers(0, 5000).map(lambda n: "a" * n),
    st.text(alphabet="ab/.-_ ~", min_size=0, max_size=600),
    st.integers(200, 3000).map(lambda n: "x/" * (n // 2)),
)


@settings(FUZZ, max_examples=60)
@given(_names, st.lists(st.tuples(st.sampled_from(COUNT_LIMITED), _huge), max_size=2, unique_by=lambda pair: pair[0]))
def test_long_names_and_huge_counts_never_traceback(model, counts):
    args = ["estimate", model]
    for option, value in counts:
        args += [option, value]
    if counts:
        args[1] = "tiny-llama"  # the count is what is tried; a bad name would stop first
    check(args)
    result = CliRunner().invoke(cli, args)
    if counts:
        assert result.exit_code == 2, (args, result.output)  # every count past its bound is refused
    assert all(len(line) < 600 for line in result.output.splitlines()), "a message repeats a name of thousands of characters"


def _outputs(folder: Path) -> dict[str, Path | str]:
    """Paths a user may name for an output, each of a kind the writer must treat as the shell would, or refuse."""
    good = folder / "real.json"
    good.write_text("old\n")
    os.mkfifo(folder / "pipe")
    (folder / "link-to-pipe").symlink_to(folder / "pipe")
    (folder / "link-to-file").symlink_to(good)
    (folder / "dangling").symlink_to(folder / "made-by-the-link.json")
    (folder / "dir").mkdir()
    outputs = {"file": good, "fifo": folder / "pipe", "link to fifo": folder / "link-to-pipe",
               "link to file": folder / "link-to-file", "dangling link": folder / "dangling", "directory": folder / "dir",
               "long name": folder / ("n" * 300), "missing folder": folder / "no" / "x.json", "dash": "-",
               "new file": folder / "new.json"}
    try:  # a character device like /dev/full, made here so that a regression cannot replace the real one
        os.mknod(folder / "device", 0o666 | stat.S_IFCHR, os.makedev(1, 7))
        outputs["device"] = folder / "device"
    except (OSError, AttributeError):
        pass
    return outputs


REFUSED_OUTPUTS = {"fifo", "link to fifo", "directory", "long name", "missing folder", "device"}


@settings(FUZZ, max_examples=40)
@given(st.sampled_from(sorted(REFUSED_OUTPUTS | {"file", "link to file", "dangling link", "dash", "new file"})),
       st.sampled_from(["plan", "measure"]))
def test_outputs_are_written_as_the_shell_would_or_refused(kind, command):
    with tempfile.TemporaryDirectory() as folder:
        outputs = _outputs(Path(folder))
        if kind not in outputs:
            return  # no device could be made here
        target = str(outputs[kind])
        modes_before = {name: os.lstat(path).st_mode for name, path in outputs.items()
                        if isinstance(path, Path) and os.path.lexists(path)}
        if command == "measure":  # only what is refused before any rank starts: a run is not fuzzed
            if kind not in REFUSED_OUTPUTS:
                return
            args = ["measure", "tiny-llama", "--nproc", "1", "--output", target]
        else:
            args = ["plan", "llama-2-7b", "--gpu", "h100-80gb", "--gpus", "8", "--offload", "none", "--checkpointing",
                    "none", "--top", "1", "--emit", "deepspeed", target]
        check(args)
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == (2 if kind in REFUSED_OUTPUTS else 0), (kind, result.output)
        for name, mode in modes_before.items():  # no link replaced, no device or FIFO turned into a file
            now = os.lstat(outputs[name]).st_mode
            assert stat.S_IFMT(now) == stat.S_IFMT(mode), (kind, name)
            if name == "file":
                assert stat.S_IMODE(now) == stat.S_IMODE(mode)
        if kind == "dash":
            assert json.loads(result.stdout)["zero_optimization"]
            assert not (Path(folder) / "-").exists()
        elif kind not in REFUSED_OUTPUTS:
            written = Path(folder) / {"file": "real.json", "link to file": "real.json",
                                      "dangling link": "made-by-the-link.json", "new file": "new.json"}[kind]
            assert json.loads(written.read_text())["zero_optimization"]
        assert not [p.name for p in Path(folder).iterdir() if p.name.startswith(".zeroplan-")]  # no temporary left


# Knobs and the configurations they do not apply to (README: "Knobs that do not apply are one-line errors").
KNOBS = {
    "--ddp": [], "--no-ddp": [], "--dropout": ["0.1"], "--pp-virtual-stages": ["2"], "--pp-schedule": ["gpipe"],
    "--sequence-parallel": [], "--no-sequence-parallel": [], "--loss-parallel": [], "--no-loss-parallel": [],
    "--moe-imbalance": ["2"], "--loss-chunks": ["4"], "--checkpoint-every": ["2"], "--lora-alpha": ["nan", "inf", "-1", "16"],
}


def _does_not_apply(engine: str, knobs: dict[str, str | None], mesh: dict[str, str]) -> bool:
    if ("--ddp" in knobs or "--no-ddp" in knobs) and engine != "torch":
        return True
    if "--dropout" in knobs and engine == "paper":
        return True
    if ({"--pp-virtual-stages", "--pp-schedule"} & set(knobs)) and "--pp" not in mesh:
        return True
    if ({"--sequence-parallel", "--no-sequence-parallel", "--loss-parallel", "--no-loss-parallel"} & set(knobs)
            and "--tp" not in mesh):
        return True
    if "--moe-imbalance" in knobs:  # tiny-llama has no experts: ep is 1
        return True
    if "--loss-chunks" in knobs:  # without a chunked loss (none is asked for here)
        return True
    if "--checkpoint-every" in knobs:  # without full checkpointing
        return True
    return "--lora-alpha" in knobs and knobs["--lora-alpha"] in ("nan", "inf", "-1", None)


@settings(FUZZ, max_examples=80)
@given(st.sampled_from(["deepspeed", "fsdp2", "torch", "paper"]),
       st.lists(st.sampled_from(sorted(KNOBS)), min_size=1, max_size=3, unique=True).flatmap(
           lambda names: st.fixed_dictionaries({name: st.sampled_from(KNOBS[name] or [None]) for name in names})),
       st.fixed_dictionaries({}, optional={"--tp": st.just("2"), "--pp": st.just("2")}))
def test_knobs_that_do_not_apply_are_refused(engine, knobs, mesh):
    args = ["estimate", "tiny-llama", "--engine", engine, "--zero", "2" if engine != "torch" else "1", "--gpus", "8",
            "--grad-accum", "2"]
    if "--lora-alpha" in knobs:
        args += ["--lora-rank", "4"]
    for option, value in (*knobs.items(), *mesh.items()):
        args += [option] + ([value] if value is not None else [])
    check(args)
    if _does_not_apply(engine, knobs, mesh):
        assert CliRunner().invoke(cli, args).exit_code == 2, args

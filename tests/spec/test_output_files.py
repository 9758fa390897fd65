"""Issue 21: files a command writes (plan --emit, measure --output, compare --plot) and its standard
output. One writer (zeroplan/spec/files.py) for all of them: through symlinks, `-` as standard output,
devices and FIFOs refused, a replaced file's mode kept, a new one's from the umask, nothing half-written,
and a name too long for the file system one line instead of a traceback."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.errors import SpecError
from zeroplan.spec.files import writable_file, write_atomic
from tests.paths import REPO

ROOT = REPO
PLAN = ["plan", "llama-2-7b", "--gpu", "h100-80gb", "--gpus", "8"]


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def one_error_line(result, pattern: str) -> str:
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and pattern in errors[0], result.output
    return errors[0]


@pytest.mark.parametrize("command", [
    [*PLAN, "--emit", "deepspeed"],
    ["measure", "tiny-llama", "--nproc", "1", "--output"],  # refused before torch is looked for
    ["compare", "llama-2-7b", "--zero", "3", "--plot"],
])
def test_a_file_name_longer_than_the_file_system_allows_is_one_line(tmp_path, command):
    target = tmp_path / ("x" * 300 + ".json")  # was: OSError: [Errno 36] File name too long
    line = one_error_line(run(*command, str(target)), "is longer than 255 bytes")
    assert len(line) < 300  # the name is shortened in the message


def test_a_long_name_within_the_limit_is_written(tmp_path):
    target = tmp_path / ("x" * 250 + ".json")  # the temporary file's name must not be the target's plus more
    result = run(*PLAN, "--emit", "deepspeed", str(target))
    assert result.exit_code == 0, result.output
    assert json.loads(target.read_text())["zero_optimization"]["stage"] in (0, 1, 2, 3)


def test_emit_writes_through_a_symlink_to_its_target(tmp_path):
    real = tmp_path / "configs" / "ds.json"
    real.parent.mkdir()
    real.write_text("old\n")
    link = tmp_path / "ds.json"
    link.symlink_to(real)
    result = run(*PLAN, "--emit", "deepspeed", str(link))
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and os.readlink(link) == str(real)  # was: the link replaced by a regular file
    assert json.loads(real.read_text())["zero_optimization"]["stage"] in (0, 1, 2, 3)
    assert sorted(p.name for p in real.parent.iterdir()) == ["ds.json"]  # no temporary file left


def test_a_dangling_symlink_creates_its_target(tmp_path):
    link = tmp_path / "ds.json"
    link.symlink_to(tmp_path / "made.json")
    assert run(*PLAN, "--emit", "deepspeed", str(link)).exit_code == 0
    assert link.is_symlink() and json.loads((tmp_path / "made.json").read_text())


def test_emit_dash_is_standard_output(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, [*PLAN, "--emit", "deepspeed", "-"])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "-").exists()  # was: a file named "-"
    config = json.loads(result.stdout)  # standard output holds the config alone; the table went to stderr
    assert config["zero_optimization"]["stage"] in (0, 1, 2, 3)
    assert "ZeRO-" in result.stderr and "wrote the deepspeed" not in result.stdout
    assert "to standard output" in result.stderr


def test_emit_fsdp_dash_is_standard_output(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["plan", "llama-2-13b", "--gpu", "a100-40gb", "--gpus", "8", "--engine", "fsdp2",
                                      "--emit", "fsdp", "-"])
    assert result.exit_code == 0, result.output
    assert "fully_shard" in result.stdout and "ZeRO-" not in result.stdout
    compile(result.stdout, "snippet", "exec")  # the snippet alone: valid Python
    assert not (tmp_path / "-").exists()


def test_a_new_file_follows_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        write_atomic(tmp_path / "new.json", "{}\n", "--emit")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o640  # was: 0600 whatever the umask


@pytest.mark.parametrize("mode", [0o644, 0o600, 0o664])
def test_a_replaced_file_keeps_its_mode(tmp_path, mode):
    target = tmp_path / "ds.json"
    target.write_text("old\n")
    target.chmod(mode)
    result = run(*PLAN, "--emit", "deepspeed", str(target))
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(target.stat().st_mode) == mode  # was: 0644 became 0600
    assert json.loads(target.read_text())


def test_a_fifo_is_refused_before_the_search(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    result = run(*PLAN, "--emit", "deepspeed", str(fifo))
    one_error_line(result, "is a FIFO (named pipe), not a regular file")
    assert "ZeRO-" not in result.output  # refused before the plan was searched
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    one_error_line(run("measure", "tiny-llama", "--nproc", "1", "--output", str(fifo)), "--output")


@pytest.mark.parametrize("device", ["/dev/null", "/dev/full"])
def test_device_files_are_refused(device):
    if not Path(device).exists():
        pytest.skip(f"{device} is missing")
    # was (as root): "wrote /dev/full", exit 0, and /dev/full replaced by a regular file. The check runs
    # before the search, so a regression fails here without writing anything.
    with pytest.raises(SpecError, match=f"--emit: {device} is a character device, not a regular file"):
        writable_file(device, "--emit")
    one_error_line(run(*PLAN, "--emit", "deepspeed", device), "is a character device")
    assert stat.S_ISCHR(Path(device).stat().st_mode)


def test_a_device_behind_a_symlink_is_refused_by_the_writer_too(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    link = tmp_path / "out.json"
    link.symlink_to(fifo)
    with pytest.raises(SpecError, match="is a FIFO"):
        write_atomic(link, "{}", "--output")  # the writer checks again: the path may have changed since
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_nothing_is_half_written_when_the_rename_fails(tmp_path, monkeypatch):
    target = tmp_path / "ds.json"
    target.write_text("old\n")

    def refuse(*_args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(SpecError, match="--emit: cannot write .*ds.json: No space left on device"):
        write_atomic(target, "new\n", "--emit")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["ds.json"]


def test_a_full_standard_output_is_one_line_and_status_2():
    if not Path("/dev/full").exists():
        pytest.skip("/dev/full is missing")
    for command in (["estimate", "llama-2-7b"], ["plan", "llama-3-70b", "--gpu", "h100-80gb", "--gpus", "8-256",
                                                  "--format", "json"]):
        with open("/dev/full", "w") as full:
            done = subprocess.run([sys.executable, "-m", "zeroplan", *command], stdout=full, stderr=subprocess.PIPE,
                                  text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
        assert done.returncode == 2, done.stderr  # was: a traceback (OSError: No space left on device), status 1 or 120
        assert done.stderr.splitlines() == ["Error: cannot write standard output: No space left on device"]


def test_compare_plot_without_matplotlib_is_refused_before_the_grid(tmp_path, monkeypatch):
    import importlib.util

    import zeroplan.plan.grid

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))

    def no_grid(*_args, **_kwargs):
        raise AssertionError("the grid was computed before the check")

    monkeypatch.setattr(zeroplan.plan.grid, "compare", no_grid)
    result = run("compare", "llama-2-7b", "--plot", str(tmp_path / "zero.png"))
    one_error_line(result, "--plot needs matplotlib: pip install 'zeroplan[plot]'")
    assert not (tmp_path / "zero.png").exists()


def test_compare_plot_writes_through_the_same_writer(tmp_path):
    pytest.importorskip("matplotlib")
    real = tmp_path / "real.png"
    link = tmp_path / "zero.png"
    link.symlink_to(real)
    result = run("compare", "llama-2-7b", "--zero", "2,3", "--plot", str(link))
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and real.read_bytes().startswith(b"\x89PNG")
    one_error_line(run("compare", "llama-2-7b", "--zero", "3", "--plot", str(tmp_path / "zero.txt")), "--plot:")

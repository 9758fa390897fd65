"""DeepSpeed's JIT builds under `measure` (issue 10, item 1): an interrupted build leaves no
compiler running and no lock behind, a stale lock is removed and a live one kept, and a build
that has to happen is announced and done before the workers start.

ninja starts each compiler in a process group of its own, so stopping a worker's process group
missed them; `fake_ninja` below does the same with `sleep` standing for the compiler.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from worker_processes import alive
from zeroplan.errors import MeasureError
from zeroplan.measure import deepspeed_build
from zeroplan.measure.deepspeed_build import ops_for
from zeroplan.measure.processes import exit_status, kill_sessions, remove_stale_lock, spawn, working_in
from zeroplan.spec.training import TrainingSpec

ROOT = Path(__file__).resolve().parent.parent
BOUND_S = 60  # waits below end in a second or two; a hang exceeds this


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))


def _wait_for(condition, what: str, bound_s: float = BOUND_S):
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"waited {bound_s} s for {what}")


# A worker that starts a "compiler" the way ninja does (its own process group), prints its pid,
# and then either keeps running or exits at once, orphaning it.
FAKE_NINJA = """
import subprocess, sys, time
compiler = subprocess.Popen(["sleep", "300"], process_group=0)
print(compiler.pid, flush=True)
if sys.argv[1] == "stay":
    time.sleep(300)
"""


@pytest.mark.parametrize("worker", ["stay", "exit"])
def test_stopping_a_worker_ends_the_compilers_it_started(worker):
    proc = spawn([sys.executable, "-c", FAKE_NINJA, worker], env=_env(), stdout=subprocess.PIPE)
    compiler = int(proc.stdout.readline())
    try:
        if worker == "stay":  # the old way: the worker's process group, which the compiler is not in
            os.killpg(proc.pid, signal.SIGKILL)
        _wait_for(lambda: exit_status(proc) is not None, "the worker to end")  # not reaped, as in the launcher
        assert alive(compiler)
        kill_sessions([proc])
        _wait_for(lambda: not alive(compiler), "the compiler to end", 10)
    finally:
        if alive(compiler):
            os.kill(compiler, signal.SIGKILL)
        proc.stdout.close()


HOLD_OPEN = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
print("holding", flush=True)
time.sleep(300)
"""


def test_a_stale_lock_is_removed_and_a_live_one_kept(tmp_path):
    build = tmp_path / "cpu_adam"
    build.mkdir()
    lock = build / "lock"
    assert remove_stale_lock(lock) == "none"
    lock.touch()  # FileBaton's lock, its owner gone (killed mid-build)
    assert remove_stale_lock(lock) == "removed"
    assert not lock.exists()

    lock.touch()
    holder = spawn([sys.executable, "-c", HOLD_OPEN, str(lock)], env=_env(), stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"holding\n"
        assert remove_stale_lock(lock) == "held"  # a live build keeps its lock open for the whole build
        assert lock.exists()
    finally:
        kill_sessions([holder])
        holder.stdout.close()

    # an orphaned compiler still writing into the folder: wait for it, do not build beside it
    compiler = spawn(["sleep", "300"], env=_env(), stdout=subprocess.DEVNULL, cwd=build)
    try:
        _wait_for(lambda: working_in(build), "the compiler to start")
        assert remove_stale_lock(lock) == "held"
    finally:
        kill_sessions([compiler])
    assert remove_stale_lock(lock) == "removed"


def _training(**fields) -> TrainingSpec:
    return TrainingSpec(engine="deepspeed", gpus=2, precision="fp32", device="cpu", **fields)


def test_the_ops_a_run_builds():
    assert ops_for(_training(zero_stage=1), None, cuda=False) == ("deepspeed_shm_comm",)
    assert ops_for(_training(zero_stage=2, offload_optimizer="cpu"), None, cuda=False) == ("deepspeed_shm_comm", "cpu_adam")
    assert ops_for(_training(zero_stage=1, optimizer="sgd"), None, cuda=False) == ("deepspeed_shm_comm",)
    assert ops_for(_training(zero_stage=1), None, cuda=True) == ("fused_adam",)
    # the user's JSON: DeepSpeed's FusedAdam unless torch_adam, CPU Adam with optimizer offload
    adamw = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 1}}
    assert ops_for(_training(zero_stage=1), adamw, cuda=False) == ("deepspeed_shm_comm", "fused_adam")
    torch_adam = adamw | {"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}
    assert ops_for(_training(zero_stage=1), torch_adam, cuda=False) == ("deepspeed_shm_comm",)
    offload = adamw | {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert ops_for(_training(zero_stage=2), offload, cuda=False) == ("deepspeed_shm_comm", "cpu_adam")


def _no_build(*args, **kwargs):
    raise AssertionError("a build process was started")


def test_built_ops_start_no_build(tmp_path, monkeypatch):
    monkeypatch.setenv(deepspeed_build.EXTENSIONS_ENV, str(tmp_path))
    monkeypatch.setattr(deepspeed_build, "spawn", _no_build)
    (deepspeed_build.ops_dir() / "cpu_adam").mkdir(parents=True)
    (deepspeed_build.ops_dir() / "cpu_adam" / "cpu_adam.so").touch()
    messages = []
    deepspeed_build.build_ahead(("cpu_adam",), env=_env(), announce=messages.append)
    assert messages == []


def test_a_failed_build_is_one_line_naming_the_op(tmp_path, monkeypatch):
    # the build process does not know this op: it exits with its usage line, as a compiler error would
    monkeypatch.setenv(deepspeed_build.EXTENSIONS_ENV, str(tmp_path))
    monkeypatch.setitem(deepspeed_build.OPS, "no_such_op", deepspeed_build.Op("NoSuchBuilder", "no_such_op", "a moment"))
    with pytest.raises(MeasureError, match=r"^building DeepSpeed's no_such_op failed: usage: .*known ops: deepspeed_shm_comm"):
        deepspeed_build.build_ahead(("no_such_op",), env=_env(), announce=print, timeout_s=BOUND_S)


def test_the_announcement_names_the_op_its_time_and_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(deepspeed_build.EXTENSIONS_ENV, str(tmp_path))
    assert deepspeed_build.announcement("cpu_adam") == (
        f"compiling DeepSpeed's cpu_adam, about a minute, once (kept in {tmp_path}; not part of the timeout)"
    )


# -- a real build, interrupted -------------------------------------------------------------------


@pytest.mark.distributed
def test_ctrl_c_during_a_build_ends_the_command_its_compilers_and_their_lock(tmp_path):
    """The issue's reproduction: `measure` with an empty extensions folder, Ctrl-C while it
    compiles. Before: the command ended, its compilers ran on and their lock stayed, so the next
    run waited on it until its timeout."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs deepspeed")
    folder = tmp_path / "ext"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(deepspeed_build.EXTENSIONS_ENV, str(folder))
        build = deepspeed_build.ops_dir() / "deepspeed_shm_comm"
    stderr = tmp_path / "stderr"
    env = _env() | {deepspeed_build.EXTENSIONS_ENV: str(folder)}
    argv = [sys.executable, "-m", "zeroplan", "measure", "tiny-llama", "--engine", "deepspeed", "--zero", "1",
            "--nproc", "2", "--precision", "fp32", "--seq-len", "64", "--timeout", "30"]
    with open(stderr, "wb") as err:
        # A job started in the background of a non-interactive shell inherits SIGINT ignored, and Python
        # keeps an ignored SIGINT: give the command the terminal's default, as a user's Ctrl-C meets it.
        command = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _wait_for(lambda: build.is_dir() and working_in(build), "a compiler in the build folder", 300)
        assert "compiling DeepSpeed's shared-memory comm op, about 35 s, once" in stderr.read_text()
        assert (build / "lock").exists()
        started = time.monotonic()
        command.send_signal(signal.SIGINT)
        command.wait(timeout=BOUND_S)
        assert command.returncode != 0
        assert time.monotonic() - started < 30  # within seconds; a hang or a finished build exceeds this
        assert working_in(build) == []  # no compiler outlives the command
        assert not (build / "lock").exists()
    finally:
        command.kill()
        command.wait()
        for pid in working_in(build):  # only if the test failed: leave nothing behind
            os.kill(pid, signal.SIGKILL)


@pytest.mark.distributed
def test_a_built_op_is_found_without_starting_a_build(deepspeed_ops, monkeypatch):
    deepspeed_ops("deepspeed_shm_comm")
    monkeypatch.setattr(deepspeed_build, "spawn", _no_build)
    messages = []
    deepspeed_build.build_ahead(("deepspeed_shm_comm",), env=_env(), announce=messages.append)
    assert messages == []


def test_each_environment_builds_into_its_own_folder(tmp_path, monkeypatch):
    """Two virtual environments sharing one folder rebuild each other's ops at every run (ninja
    sees other include paths): the folder is keyed on Python, torch, DeepSpeed and the venv."""
    monkeypatch.setenv(deepspeed_build.EXTENSIONS_ENV, str(tmp_path))
    here = deepspeed_build.ops_dir()
    assert here.parent == tmp_path
    assert here.name.startswith(f"py{sys.version_info.major}{sys.version_info.minor}-torch")
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another-venv"))
    assert deepspeed_build.ops_dir() != here
    # a process given torch_env() finds the same folder, not a subfolder of it
    monkeypatch.setattr(os, "environ", dict(os.environ, **deepspeed_build.torch_env()))
    assert deepspeed_build.ops_dir() == Path(os.environ["TORCH_EXTENSIONS_DIR"])

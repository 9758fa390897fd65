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
import tempfile
import time
from pathlib import Path

import pytest

from tests.worker_processes import alive
from zeroplan.errors import MeasureError
from zeroplan.measure import deepspeed_build
from zeroplan.measure.deepspeed_build import ops_for
from zeroplan.measure.processes import exit_status, kill_sessions, remove_stale_lock, spawn, working_in
from zeroplan.spec.training import TrainingSpec
from tests.paths import REPO

ROOT = REPO
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


def _fake_build(op_folder: Path, name: str, finished: bool = True) -> Path:
    """What ninja leaves in `op_folder`: objects, the .so, and its log, which records the .so only once
    the link finished (start, end, mtime in ns, output, command hash)."""
    op_folder.mkdir(parents=True, exist_ok=True)
    (op_folder / f"{name}.o").write_bytes(b"object")
    library = op_folder / f"{name}.so"
    library.write_bytes(b"library")
    lines = ["# ninja log v5", f"0\t10\t{(op_folder / f'{name}.o').stat().st_mtime_ns}\t{name}.o\t1234abcd"]
    if finished:
        lines.append(f"10\t20\t{library.stat().st_mtime_ns}\t{name}.so\tabcd1234")
    (op_folder / ".ninja_log").write_text("\n".join(lines) + "\n")
    return library


def test_built_ops_start_no_build(tmp_path, monkeypatch):
    monkeypatch.setenv(deepspeed_build.EXTENSIONS_ENV, str(tmp_path))
    monkeypatch.setattr(deepspeed_build, "spawn", _no_build)
    _fake_build(deepspeed_build.ops_dir() / "cpu_adam", "cpu_adam")
    messages = []
    deepspeed_build.build_ahead(("cpu_adam",), env=_env(), announce=messages.append)
    assert messages == []


def test_an_op_is_built_when_its_so_is_the_one_ninja_recorded(tmp_path):
    """A build killed before or during its link leaves objects and maybe a partial .so: before issue 21
    a .so counted as built, and the workers imported what was there."""
    op_folder = tmp_path / "cpu_adam"
    library = _fake_build(op_folder, "cpu_adam")
    assert deepspeed_build.built("cpu_adam", tmp_path)
    library.write_bytes(b"a link killed half-way")  # rewritten after ninja logged it
    os.utime(library, ns=(library.stat().st_atime_ns, library.stat().st_mtime_ns + 1))
    assert not deepspeed_build.built("cpu_adam", tmp_path)
    _fake_build(op_folder, "cpu_adam", finished=False)  # killed before the link finished
    assert not deepspeed_build.built("cpu_adam", tmp_path)
    (op_folder / ".ninja_log").unlink()
    assert not deepspeed_build.built("cpu_adam", tmp_path)

    (op_folder / "lock").touch()
    (op_folder / deepspeed_build.BUILD_LOCK).touch()
    assert deepspeed_build.clean_half_built(op_folder)
    assert sorted(p.name for p in op_folder.iterdir()) == sorted(["lock", deepspeed_build.BUILD_LOCK])
    assert not deepspeed_build.clean_half_built(op_folder)


@pytest.mark.parametrize("where", ["a file", "/proc/zp"])
def test_an_extensions_folder_that_cannot_be_used_is_one_line_naming_the_variable(tmp_path, monkeypatch, where):
    """Before issue 21: a NotADirectoryError traceback (set to a file), or a bare FileNotFoundError (/proc/zp)."""
    path = tmp_path / "a-file" if where == "a file" else Path(where)
    if where == "a file":
        path.write_text("")
    monkeypatch.setenv(deepspeed_build.EXTENSIONS_ENV, str(path))
    monkeypatch.setattr(deepspeed_build, "spawn", _no_build)
    message = rf"^{deepspeed_build.EXTENSIONS_ENV}: {path} cannot hold DeepSpeed's built ops \(.+\); set it to a folder"
    with pytest.raises(MeasureError, match=message):
        deepspeed_build.build_ahead(("deepspeed_shm_comm",), env=_env(), announce=print)
    with pytest.raises(MeasureError, match=message):  # with nothing to build too: the workers write there
        deepspeed_build.build_ahead((), env=_env(), announce=print)
    monkeypatch.delenv(deepspeed_build.EXTENSIONS_ENV)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(path))
    with pytest.raises(MeasureError, match="^TORCH_EXTENSIONS_DIR: "):
        deepspeed_build.build_ahead(("deepspeed_shm_comm",), env=_env(), announce=print)


def test_an_unusable_extensions_folder_stops_measure_with_one_line(tmp_path):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs deepspeed")
    (tmp_path / "a-file").write_text("")
    env = _env() | {deepspeed_build.EXTENSIONS_ENV: str(tmp_path / "a-file")}
    argv = [sys.executable, "-m", "zeroplan", "measure", "tiny-llama", "--engine", "deepspeed", "--zero", "1",
            "--nproc", "2", "--precision", "fp32", "--seq-len", "32"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=BOUND_S, stdin=subprocess.DEVNULL)
    assert done.returncode == 2
    assert done.stderr.startswith(f"Error: {deepspeed_build.EXTENSIONS_ENV}: {tmp_path / 'a-file'} cannot hold "
                                  "DeepSpeed's built ops (Not a directory: "), done.stderr
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr


HOLD_BUILD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("holding", flush=True)
sys.stdin.readline()
"""


def test_a_build_that_waits_for_another_says_so_and_nothing_false(tmp_path, monkeypatch):
    """Two first builds at once: before issue 21 the waiting one also said "compiling ..., about 35 s"
    although the other build had finished the op by then. Here another zeroplan's build holds the op's
    lock, finishes it while this one waits, and releases the lock."""
    monkeypatch.setenv(deepspeed_build.EXTENSIONS_ENV, str(tmp_path))
    op_folder = deepspeed_build.ops_dir() / "deepspeed_shm_comm"
    op_folder.mkdir(parents=True)
    other = spawn([sys.executable, "-c", HOLD_BUILD_LOCK, str(op_folder / deepspeed_build.BUILD_LOCK)], env=_env(),
                  stdout=subprocess.PIPE, stdin=subprocess.PIPE)
    try:
        assert other.stdout.readline() == b"holding\n"
        messages = []

        def announce(message: str) -> None:
            messages.append(message)
            if message.startswith("waiting"):  # the other build finishes and lets go
                _fake_build(op_folder, "deepspeed_shm_comm")
                other.stdin.write(b"done\n")
                other.stdin.flush()

        deepspeed_build.build_ahead(("deepspeed_shm_comm",), env=_env(), announce=announce, timeout_s=BOUND_S)
    finally:
        kill_sessions([other])
        other.stdout.close()
        other.stdin.close()
    assert messages == [f"waiting for another zeroplan's build of DeepSpeed's shared-memory comm op (in {op_folder})"]


# A build child as deepspeed_build starts it: its death signal SIGTERM, ended by processes.end_session;
# it starts a "compiler" in a process group of its own, as ninja does, and prints its pid.
FAKE_BUILD = """
import signal, subprocess, sys, time
from zeroplan.measure.processes import end_session
end_session(signal.SIGTERM)
compiler = subprocess.Popen(["sleep", "300"], process_group=0)
print(compiler.pid, flush=True)
time.sleep(300)
"""

# The command: starts the build child as build_ahead does, prints its pid and the compiler's, and waits.
FAKE_COMMAND = """
import signal, subprocess, sys, time
from zeroplan.measure.processes import spawn
child = spawn([sys.executable, "-c", sys.argv[1]], env=None, stdout=subprocess.PIPE, death_signal=signal.SIGTERM)
print(child.pid, child.stdout.readline().decode().strip(), flush=True)
time.sleep(300)
"""


def test_a_command_killed_outright_takes_its_build_and_compilers_with_it():
    """Before issue 21: SIGKILL of the command killed the build child (PR_SET_PDEATHSIG) but not ninja and
    the compilers, which the death signal does not reach; they ran on, in the build folder."""
    command = subprocess.Popen([sys.executable, "-c", FAKE_COMMAND, FAKE_BUILD], env=_env(), stdout=subprocess.PIPE,
                               stdin=subprocess.DEVNULL)
    child, compiler = map(int, command.stdout.readline().split())
    try:
        assert alive(child) and alive(compiler)
        command.kill()
        command.wait(timeout=BOUND_S)
        _wait_for(lambda: not alive(compiler) and not alive(child), "the build and its compiler to end", 10)
    finally:
        command.stdout.close()
        for pid in (child, compiler):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


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
    folder, tmpdir = tmp_path / "ext", tmp_path / "tmp"
    tmpdir.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(deepspeed_build.EXTENSIONS_ENV, str(folder))
        build = deepspeed_build.ops_dir() / "deepspeed_shm_comm"
    stderr = tmp_path / "stderr"
    env = _env() | {deepspeed_build.EXTENSIONS_ENV: str(folder), "TMPDIR": str(tmpdir)}
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
        # nor its temporary files (before issue 21: gcc's cc*.s and DeepSpeed's tmp*/test.c stayed in $TMPDIR)
        assert list(tmpdir.iterdir()) == []
    finally:
        command.kill()
        command.wait()
        for pid in working_in(build):  # only if the test failed: leave nothing behind
            os.kill(pid, signal.SIGKILL)


# The build child (`python -m zeroplan.measure.deepspeed_build --child OP`) with one difference: before torch's
# `load` runs ninja in the op's build folder, the kept folder's build of the op is copied there (ninja's outputs,
# its log and dependency record, their times kept), so ninja finds nothing to compile. The locks, the clean-up,
# the report, DeepSpeed's builder, torch's `load`, ninja and the import of the .so are the child's own.
KEPT_BUILD_CHILD = """
import os, shutil
from pathlib import Path
import torch.utils.cpp_extension as cpp_extension
from zeroplan.measure import deepspeed_build

KEPT = Path({kept!r})
load = cpp_extension.load

def load_on_the_kept_build(name, *args, **kwargs):
    folder = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / name  # deepspeed_build.torch_env: the build folder
    for path in (KEPT / name).iterdir():
        if path.name not in (deepspeed_build.BUILD_LOCK, deepspeed_build.TORCH_LOCK):
            shutil.copy2(path, folder / path.name)
    return load(name, *args, **kwargs)

cpp_extension.load = load_on_the_kept_build  # DeepSpeed's OpBuilder.jit_load imports it when it runs
deepspeed_build.main()
"""


@pytest.mark.distributed
def test_sigkill_during_a_build_ends_its_compilers_and_the_next_run_cleans_up_and_builds(tmp_path, monkeypatch,
                                                                                          deepspeed_ops):
    """Issue 21: SIGKILL of `measure` during its first DeepSpeed build left ninja, c++ and cc1plus running
    and their lock in place; the next run waited on the lock, then imported a .so nobody had linked
    (ImportError ... deepspeed_shm_comm.so: cannot open shared object file), and the build's run folder
    and temporary files stayed in $TMPDIR.

    The killed build is a real one; the next run's build child is the real one too, but what its ninja
    would compile is the kept folder's build of the op (KEPT_BUILD_CHILD), which the suite's other
    DeepSpeed tests use: the op is compiled once in the suite, not twice."""
    deepspeed_ops("deepspeed_shm_comm")
    kept = deepspeed_build.ops_dir()
    folder, tmpdir, stand_in = tmp_path / "ext", tmp_path / "tmp", tmp_path / "stand_in"
    tmpdir.mkdir()
    monkeypatch.setenv(deepspeed_build.EXTENSIONS_ENV, str(folder))
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    build = deepspeed_build.ops_dir() / "deepspeed_shm_comm"
    argv = [sys.executable, "-m", "zeroplan", "measure", "tiny-llama", "--engine", "deepspeed", "--zero", "1",
            "--nproc", "2", "--precision", "fp32", "--seq-len", "32", "--timeout", "120"]
    command = subprocess.Popen(argv, env=_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: build.is_dir() and working_in(build), "a compiler in the build folder", 300)
        command.kill()
        command.wait(timeout=BOUND_S)
        _wait_for(lambda: working_in(build) == [], "the compilers to end", 10)
        _wait_for(lambda: not (build / "lock").exists(), "the build to free its lock", 10)
        assert list(tmpdir.glob(f"zeroplan-build-{command.pid}.*"))  # nothing ran to remove it
    finally:
        command.kill()
        command.wait()
        for pid in working_in(build):  # only if the test failed: leave nothing behind
            os.kill(pid, signal.SIGKILL)

    from zeroplan.importers.catalog import resolve_model
    from zeroplan.measure.launcher import run_measurement

    stand_in.mkdir()
    (stand_in / "kept_build_child.py").write_text(KEPT_BUILD_CHILD.format(kept=str(kept)))
    monkeypatch.setattr(deepspeed_build, "MODULE", "kept_build_child")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(stand_in), os.environ.get("PYTHONPATH")) if p))
    messages = []
    training = _training(zero_stage=1, micro_batch=1, seq_len=32, recipe="plain",
                         deepspeed={"reduce_bucket_size": 100_000, "allgather_bucket_size": 100_000})
    result = run_measurement(resolve_model("tiny-llama"), training, nproc=2,
                             steps=2, timeout_s=300, announce=messages.append)  # the workers import the op
    assert result.fits
    assert messages[0] == (f"removed the unfinished build of DeepSpeed's shared-memory comm op that a stopped run "
                           f"left in {build}")
    assert messages[1].startswith("compiling DeepSpeed's shared-memory comm op")
    assert deepspeed_build.built("deepspeed_shm_comm", deepspeed_build.ops_dir())
    # the killed run's folder with its cc*.s, and this run's own (torchinductor_USER: torch's compile cache, kept by design)
    assert [path.name for path in tmpdir.iterdir() if not path.name.startswith("torchinductor_")] == []


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

"""A `measure` or `validate` killed outright (SIGKILL) cannot remove its folders in $TMPDIR; before
issue 21 they stayed there forever (`zeroplan-measure-*`, `zeroplan-build-*`). They are named for
their owner (pid and start time) and the next run removes those whose owner is gone: only ours,
only folders, never one whose owner runs (measure/processes.py `run_folder`, `remove_dead_run_folders`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests.worker_processes import alive
from zeroplan.measure import processes
from zeroplan.measure.processes import process_start, remove_dead_run_folders, run_folder
from tests.paths import REPO

NS = str(os.stat("/proc/self/ns/pid").st_ino) if os.path.exists("/proc/self/ns/pid") else "0"  # our pid namespace

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

ROOT = REPO
BOUND_S = 120  # a tiny run on 2 busy cores takes seconds; a hang exceeds this


@pytest.fixture
def tmpdir_here(tmp_path, monkeypatch):
    """tempfile's directory (and $TMPDIR for children) set to a folder of this test's own."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.setenv("TMPDIR", str(folder))
    return folder


def _descendants(pid: int) -> list[int]:
    """The processes `pid` started, and theirs (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        try:
            ppid = int(open(f"/proc/{entry}/stat").read().rpartition(")")[2].split()[1]) if entry.isdigit() else None
        except OSError:
            continue
        if ppid is not None:
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)  # reaped: the pid names no process now
    return child.pid


def test_a_run_folder_names_its_owner(tmpdir_here):
    folder = run_folder("measure")
    assert folder.parent == tmpdir_here
    assert folder.name.startswith(f"zeroplan-measure-{os.getpid()}.{process_start(os.getpid())}.{NS}-")
    with pytest.raises(ValueError, match="kind"):
        run_folder("other")


def test_only_our_folders_whose_owner_is_gone_are_removed(tmpdir_here):
    live = run_folder("build")
    (live / "build.log").write_text("a build running now")
    dead = tmpdir_here / f"zeroplan-measure-{_dead_pid()}.1234.{NS}-abcd1234"
    (dead / "tmp" / "tmpq1w2e3").mkdir(parents=True)  # what a killed build leaves: gcc's cc*.s, DeepSpeed's test.c
    (dead / "tmp" / "ccAbCdEf.s").write_text("")
    reused = tmpdir_here / f"zeroplan-build-{os.getpid()}.1.{NS}-abcd1234"  # our pid, another start: an earlier owner
    reused.mkdir()
    kept = {
        "unnamed": tmpdir_here / "zeroplan-measure-abcd1234",  # an older version's name: no owner to ask
        "other prefix": tmpdir_here / f"pytest-of-{_dead_pid()}.1234.{NS}-abcd1234",
        "another user's": tmpdir_here / f"zeroplan-trainer-{_dead_pid()}.1234.{NS}-abcd1234",
        "another pid namespace's": tmpdir_here / f"zeroplan-measure-{_dead_pid()}.1234.1{NS}-abcd1234",  # a container's
    }
    for folder in kept.values():
        folder.mkdir()
    os.chown(kept["another user's"], 65534, 65534) if os.getuid() == 0 else kept.pop("another user's")
    target = tmpdir_here / "target"
    target.mkdir()
    link = tmpdir_here / f"zeroplan-measure-{_dead_pid()}.1234.{NS}-link1234"
    link.symlink_to(target)
    afile = tmpdir_here / f"zeroplan-build-{_dead_pid()}.1234.{NS}-file1234"
    afile.write_text("not a folder")

    removed = remove_dead_run_folders()

    assert sorted(removed) == sorted([dead, reused])
    assert not dead.exists() and not reused.exists()
    assert live.is_dir() and (live / "build.log").exists()
    assert all(folder.is_dir() for folder in kept.values())
    assert link.is_symlink() and target.is_dir() and afile.is_file()


def test_without_proc_a_live_pid_keeps_its_folder(tmpdir_here, monkeypatch):
    monkeypatch.setattr(processes, "PROC", tmpdir_here / "no-proc")
    mine = tmpdir_here / f"zeroplan-measure-{os.getpid()}.0.0-abcd1234"
    mine.mkdir()
    dead = tmpdir_here / f"zeroplan-measure-{_dead_pid()}.0.0-abcd1234"
    dead.mkdir()
    assert remove_dead_run_folders() == [dead]
    assert mine.is_dir()


@pytest.mark.distributed
def test_a_killed_measure_leaves_its_folder_and_the_next_run_removes_it(tmpdir_here):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    argv = [sys.executable, "-m", "zeroplan", "measure", "tiny-llama", "--engine", "torch", "--zero", "0", "--nproc", "2",
            "--precision", "fp32", "--seq-len", "32", "--steps", "50", "--timeout", str(BOUND_S)]
    command = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + BOUND_S
        while not list(tmpdir_here.glob("zeroplan-measure-*/rank0.log")) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = list(tmpdir_here.glob(f"zeroplan-measure-{command.pid}.*"))
        assert len(left) == 1, list(tmpdir_here.iterdir())
        started = _descendants(command.pid)  # its worker server and the workers
        command.send_signal(signal.SIGKILL)
        command.wait(timeout=BOUND_S)
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in started) and time.monotonic() < deadline:  # they die with it (PDEATHSIG)
            time.sleep(0.05)
        assert started and not any(alive(pid) for pid in started)
    finally:
        command.kill()
        command.wait()
    assert left[0].is_dir()  # nothing ran to remove it

    from zeroplan.measure.launcher import run_measurement
    from zeroplan.importers.catalog import resolve_model
    from zeroplan.spec.training import TrainingSpec

    training = TrainingSpec(engine="torch", zero_stage=0, gpus=1, precision="fp32", micro_batch=1, seq_len=16,
                            device="cpu", recipe="plain")
    run_measurement(resolve_model("tiny-llama"), training, nproc=1, steps=2, timeout_s=BOUND_S)
    assert not left[0].exists()
    assert list(tmpdir_here.glob("zeroplan-measure-*")) == []  # and its own is gone too

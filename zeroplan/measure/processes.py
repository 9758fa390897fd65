"""Child processes of a measurement (workers, a build) and what they leave behind, read from /proc.

Every child runs in its own session (`spawn`, or forked by `worker_server.start`), and `kill_sessions` ends the whole session: the
child and everything it started, compilers included. `remove_stale_lock` removes a lock file that
torch's `FileBaton` left when its owner died; a live build's lock is never touched.
Without /proc (not Linux) only the children's process groups are killed and no lock is removed.

A command killed outright (SIGKILL) cleans nothing up: its children die with it (`die_with_parent`;
a child that has children of its own ends its session first, `end_session`), and the folders it made
in the temporary directory (`run_folder`, named for their owner's pid and start time) are removed
by the next run (`remove_dead_run_folders`).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROC = Path("/proc")
SWEEP_S = 5.0  # how long kill_sessions keeps sweeping processes that are still being forked


def die_with_parent(parent_pid: int, signum: int = signal.SIGKILL) -> None:  # pragma: no cover - runs in the child after the fork
    """Linux: send this child `signum` (SIGKILL unless it must clean up first, see `end_session`) if its
    parent (the launcher, or the worker server that forked it) dies without cleaning up (itself
    SIGKILLed). A parent that died between the fork and the prctl sent no signal (prctl(2): the death
    signal applies to a parent dying after the call), so the child checks it still has that parent.
    The death signal survives exec (prctl(2)), and reaches this child only, not what it starts."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1  # linux/prctl.h
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)


def spawn(argv: list[str], *, env: dict[str, str], stdout, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
          death_signal: int = signal.SIGKILL, **kwargs) -> subprocess.Popen:
    """Start `argv` in a new session (its session id is its pid), to be ended by `kill_sessions`; it is
    sent `death_signal` if this process dies first (`die_with_parent`)."""
    return subprocess.Popen(
        argv, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
        start_new_session=True, preexec_fn=functools.partial(die_with_parent, os.getpid(), death_signal), **kwargs,
    )


def end_session(signum: int, cleanup=None) -> None:
    """In a child started by `spawn(..., death_signal=signum)` that starts children of its own (a build:
    ninja, then compilers in process groups of their own): on `signum`, SIGKILL every other process of
    this session, run `cleanup`, and exit. PR_SET_PDEATHSIG reaches only the direct child, so without
    this a command killed outright left its compilers running (issue 21)."""

    def handler(received, frame):  # pragma: no cover - runs in the child; tests/measure/test_deepspeed_build.py kills one
        kill_session_members(os.getsid(0))
        if cleanup is not None:
            cleanup()
        os._exit(128 + received)

    signal.signal(signum, handler)


def kill_session_members(session_id: int) -> None:
    """SIGKILL every process of session `session_id` but this one, sweeping until none is left (or SWEEP_S)."""
    sweep_sessions({session_id}, spare=os.getpid())


def sweep_sessions(sessions: set[int], spare: int | None = None) -> None:
    """SIGKILL every process of `sessions` but `spare`, sweeping until none is left (or SWEEP_S): a
    process may start a child between one look at /proc and the kill."""
    deadline = time.monotonic() + SWEEP_S
    while sessions and PROC.is_dir() and time.monotonic() < deadline:
        members = [pid for pid in session_members(sessions) if pid != spare]
        if not members:
            return
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)


def _stat_fields(pid: str) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name: state, ppid, pgrp, session, ..."""
    try:
        text = (PROC / pid / "stat").read_text()
    except OSError:
        return None
    return text.rpartition(")")[2].split()


def _pids() -> list[str]:
    try:
        return [entry for entry in os.listdir(PROC) if entry.isdigit()]
    except OSError:
        return []


def process_start(pid: int) -> str | None:
    """When `pid` started (clock ticks since boot, /proc/PID/stat field 22), None if it is not running or
    there is no /proc: with the pid, it names one process, since a pid is reused but not at the same time."""
    fields = _stat_fields(str(pid))
    return fields[19] if fields and len(fields) > 19 else None  # fields[0] is field 3 (state)


def session_members(session_ids: set[int]) -> list[int]:
    """Live (not zombie) processes whose session id is in `session_ids`."""
    found = []
    for pid in _pids():
        fields = _stat_fields(pid)
        if fields and fields[0] != "Z" and int(fields[3]) in session_ids:
            found.append(int(pid))
    return found


def exit_status(proc) -> int | None:
    """`proc`'s exit status (negative: killed by that signal), or None while it runs; unlike
    `proc.poll()` it does not reap `proc`, so its pid, the id of its session, cannot be reused
    by another program's session before `kill_sessions` has swept it.

    A forked worker (`worker_server.Worker`) is not this process's child: its server reads its
    status the same way (`unreaped_status`) and reaps it only when `kill_sessions` has swept it."""
    if not isinstance(proc, subprocess.Popen):
        return proc.returncode
    if not hasattr(os, "waitid"):
        return proc.poll()
    if proc.returncode is not None:
        return proc.returncode
    return unreaped_status(proc.pid)


def unreaped_status(pid: int) -> int | None:
    """The exit status of child `pid` (negative: killed by that signal), or None while it runs, leaving
    it unreaped (waitid's WNOWAIT): a zombie keeps its pid, and so its session id, from being reused."""
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None or info.si_pid == 0:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def kill_sessions(procs: list) -> None:
    """SIGKILL every process in the sessions of `procs` (each started by `spawn`, or a worker forked
    in a session of its own by `worker_server.start`), then reap `procs`."""
    # Only sessions whose leader is not reaped yet (alive or a zombie): their id cannot be reused.
    sessions = {proc.pid for proc in procs if proc.returncode is None}
    for pid in sessions:
        _signal_group(pid)
    # By session, not by process group or by walking children: ninja starts each compiler in a
    # new process group, and a compiler whose parent died is reparented away from the tree, but
    # both keep the session that start_new_session gave the child.
    sweep_sessions(sessions)
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not wait on the process
            pass


def _signal_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)  # start_new_session: the group id is the pid
    except (ProcessLookupError, PermissionError):
        pass


def lock_holders(lock: Path) -> list[int] | None:
    """Processes that have `lock` open (torch's FileBaton keeps its lock open for the whole build);
    None when that cannot be known (no /proc, or a process of the lock's owner is unreadable)."""
    try:
        target = lock.stat()
    except OSError:
        return []
    if not PROC.is_dir():
        return None
    holders = []
    for pid in _pids():
        try:
            fds = os.listdir(PROC / pid / "fd")
        except FileNotFoundError:
            continue  # exited meanwhile
        except PermissionError:
            if _uid(pid) == target.st_uid:
                return None  # the owner's user, and we cannot look: assume it holds the lock
            continue
        for fd in fds:
            try:
                st = os.stat(PROC / pid / "fd" / fd)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                holders.append(int(pid))
                break
    return holders


def _uid(pid: str) -> int | None:
    try:
        for line in (PROC / pid / "status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def working_in(folder: Path) -> list[int]:
    """Processes whose working directory is `folder` (torch runs ninja there, and ninja its compilers)."""
    found, target = [], str(folder.resolve())
    for pid in _pids():
        try:
            if os.readlink(PROC / pid / "cwd") == target:
                found.append(int(pid))
        except OSError:
            continue
    return found


def remove_stale_lock(lock: Path) -> str:
    """Remove `lock` if its owner is gone; return "none", "removed", or "held" (a live build's,
    left in place: someone has it open, a compiler still runs in its folder, or we cannot tell)."""
    try:
        before = lock.stat()
    except OSError:  # no lock, no such folder (ZEROPLAN_TORCH_EXTENSIONS_DIR a file), or none we may see
        return "none"
    holders = lock_holders(lock)
    if holders is None or holders or working_in(lock.parent):
        return "held"
    try:
        after = lock.stat()
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
            return "held"  # replaced meanwhile: a new build took it
        lock.unlink()
    except FileNotFoundError:
        return "none"
    return "removed"


RUN_FOLDER_KINDS = ("measure", "build", "trainer")  # the launcher's, a DeepSpeed build's, the Trainer's output_dir
_RUN_FOLDER = re.compile(r"zeroplan-(?:" + "|".join(RUN_FOLDER_KINDS) + r")-(\d+)\.(\d+)\.(\d+)-[A-Za-z0-9_]+")


def _pid_namespace() -> str:
    """This process's pid namespace (the inode of /proc/self/ns/pid), "0" where it cannot be read: a pid
    means a process only within its namespace (a container sharing /tmp has its own)."""
    try:
        return str(os.stat(PROC / "self" / "ns" / "pid").st_ino)
    except OSError:
        return "0"


def run_folder(kind: str) -> Path:
    """A new folder in the temporary directory for this process's run: zeroplan-KIND-PID.START.NS-xxxxxxxx,
    named for its owner (pid, start time, pid namespace) so that a later run can tell it was left by a
    process that is gone (killed outright: nothing ran to remove it) and remove it (`remove_dead_run_folders`)."""
    if kind not in RUN_FOLDER_KINDS:
        raise ValueError(f"kind: {kind!r} is not one of {', '.join(RUN_FOLDER_KINDS)}")
    pid = os.getpid()
    return Path(tempfile.mkdtemp(prefix=f"zeroplan-{kind}-{pid}.{process_start(pid) or 0}.{_pid_namespace()}-"))


def _owner_alive(pid: int, start: str, namespace: str) -> bool:
    """Whether the process that made a run folder may still run: its pid runs and started when it did.
    A folder of another pid namespace, or any folder where there is no /proc and the pid is live, counts
    as in use (never remove what might be)."""
    if namespace != _pid_namespace():
        return True
    if PROC.is_dir():
        return process_start(pid) == start
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead_run_folders(parent: Path | None = None) -> list[Path]:
    """Remove the run folders (`run_folder`) in `parent` (the temporary directory) whose owner has ended,
    and return them. Only folders of this user, named as `run_folder` names them, that are not links,
    made in this pid namespace, and whose owner is not running (a reused pid has another start time)
    are touched."""
    parent = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        match = _RUN_FOLDER.fullmatch(entry.name)
        if not match:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or _owner_alive(int(match[1]), match[2], match[3]):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(Path(entry.path))
    return removed


def last_line(log: Path) -> str:
    """The last non-empty line of a child's log: the one-line reason it failed."""
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[2])  # zeroplan/measure/processes.py -> the folder holding zeroplan/


def child_env(backend: str | None) -> dict[str, str]:
    """The environment of every child: this package importable, DeepSpeed on its CPU accelerator for gloo."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_package_root(), env.get("PYTHONPATH")) if p)
    if backend == "gloo":
        env.setdefault("DS_ACCELERATOR", "cpu")  # as deepspeed_engine.prepare_environment
    return env

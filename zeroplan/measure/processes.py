"""Child processes of a measurement (workers, a build) and what they leave behind, read from /proc.

Every child runs in its own session (`spawn`, or forked by `worker_server.start`), and `kill_sessions` ends the whole session: the
child and everything it started, compilers included. `remove_stale_lock` removes a lock file that
torch's `FileBaton` left when its owner died; a live build's lock is never touched.
Without /proc (not Linux) only the children's process groups are killed and no lock is removed.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PROC = Path("/proc")
SWEEP_S = 5.0  # how long kill_sessions keeps sweeping processes that are still being forked


def die_with_parent(parent_pid: int) -> None:  # pragma: no cover - runs in the child after the fork
    """Linux: SIGKILL this child if its parent (the launcher, or the worker server that forked it) dies
    without cleaning up (itself SIGKILLed). A parent that died between the fork and the prctl sent no
    signal (prctl(2): the death signal applies to a parent dying after the call), so the child checks
    it still has that parent."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1  # linux/prctl.h
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)


def spawn(argv: list[str], *, env: dict[str, str], stdout, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
          **kwargs) -> subprocess.Popen:
    """Start `argv` in a new session (its session id is its pid), to be ended by `kill_sessions`."""
    return subprocess.Popen(
        argv, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
        start_new_session=True, preexec_fn=functools.partial(die_with_parent, os.getpid()), **kwargs,
    )


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
    deadline = time.monotonic() + SWEEP_S
    while sessions and PROC.is_dir():
        members = session_members(sessions)
        if not members or time.monotonic() > deadline:
            break
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)
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
    except FileNotFoundError:
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
    except FileNotFoundError:
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

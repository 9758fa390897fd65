"""Start measurement workers by forking them from a server that has imported torch once.

Why: a worker is a fresh Python whose start is mostly importing torch and `torch._dynamo` (every
torch optimizer imports it): 84% of a 2-step tiny-llama run (bench/test_suite_time.md). A
command that measures many runs (`zeroplan validate`, the test suite) paid that import once per
rank and run; forked from a server that imported `server_preload` once, a worker starts in a
fraction of a second. The worker program is `python -m zeroplan.measure.worker`'s `main` (torchrun
runs that module on several nodes); only its start differs.

The server is `python -m zeroplan.measure.worker_server`, one per launcher process, started with
the first worker. It reads requests from its stdin and answers on its stdout, one JSON object a line:
  {"start": {"argv": [...], "env": {...}, "log": PATH}}  ->  {"started": PID}
                                                           {"exited": PID, "status": S}, when it ends
  {"release": PID}                                          (reap PID: its session may be swept first)
It ends when the launcher does (end of its stdin, or PR_SET_PDEATHSIG when the launcher is killed),
and is replaced when the launcher's environment changes, since its imports read the environment it
started with (`running_server`).

A forked worker runs as a fresh process would: in its own session, so the launcher's
`kill_sessions` ends it and whatever it started; killed when its server dies (PR_SET_PDEATHSIG);
stdin from /dev/null, stdout and stderr in its log; exactly the environment the launcher gives it
(os.environ replaced), torch's intra-op thread count set from its OMP_NUM_THREADS (torch read that
variable at its import in the server) and Ctrl-C's default handler back.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from zeroplan.errors import MeasureError

POLL_S = 0.02  # how often the server looks for workers that exited
START_S = 300.0  # the longest the server may take to import what it preloads (seconds on 2 loaded cores)
ANSWER_S = 60.0  # the longest a fork may take to be answered


class _Server:
    """The launcher's side: the server process and what it has reported."""

    def __init__(self, env: dict[str, str]):
        from zeroplan.measure.processes import spawn

        self.env = env  # what its imports read (server_preload)
        self.proc = spawn([sys.executable, "-m", __name__], env=env, stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=None)
        self._pending = b""
        self.ended = False  # its stdout reached its end: the server has exited or is exiting
        self.statuses: dict[int, int] = {}  # exit status of each worker reported and not yet released
        self.lock = threading.Lock()
        try:
            self.pid = self._expect("ready", START_S)
        except MeasureError:
            self.proc.kill()  # its session: it has started no worker yet
            self.proc.wait()
            raise

    def alive(self) -> bool:
        return self.proc.poll() is None

    def request(self, message: dict, answer: str | None = None) -> int | None:
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.flush()
        return self._expect(answer, ANSWER_S) if answer else None

    def drain(self) -> None:
        """Read the exit reports the server has written so far."""
        while self._read_line(timeout=0) is not None:
            pass

    def _expect(self, key: str, timeout_s: float) -> int:
        """The value of the next message holding `key`; MeasureError if the server ends or is silent for `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            message = self._read_line(timeout=max(deadline - time.monotonic(), 0.0))
            if message is not None and key in message:
                return message[key]
            if message is None and self.ended:
                raise MeasureError(f"the worker server ended (exit status {self.proc.wait()}) before it said {key!r}")
            if message is None and time.monotonic() >= deadline:
                raise MeasureError(f"the worker server did not say {key!r} within {timeout_s:g} s")

    def _read_line(self, timeout: float | None) -> dict | None:
        """The next message (exit reports are recorded on the way); None if there is none yet, or at the end."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                self.ended = True
                return None
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        message = json.loads(line)
        if "exited" in message:
            self.statuses[message["exited"]] = message["status"]
        return message


_server: _Server | None = None
_server_lock = threading.Lock()


def running_server() -> _Server:
    """This process's server, started now if it is not running (a launcher thread that started it
    may have exited: PR_SET_PDEATHSIG follows the thread, so the server is then started again), or
    started again if this process's environment has changed since: its imports read the
    environment it started with, a fresh worker's would read the launcher's of now."""
    from zeroplan.measure.processes import child_env

    global _server
    env = child_env(None)
    with _server_lock:
        if _server is not None and _server.alive() and _import_settings(_server.env) != _import_settings(env):
            _stop(_server)
            _server = None
        if _server is None or not _server.alive():
            _server = _Server(env)
        return _server


def _import_settings(env: dict[str, str]) -> dict[str, str]:
    """The environment without the variables that change from run to run in one process and that no
    import reads: a worker's fault injection (read at run time) and pytest's name of the running
    test (set anew for every test: without this, each test would start a server)."""
    from zeroplan.measure.worker import FAULT_ENV

    return {name: value for name, value in env.items() if name not in (FAULT_ENV, "PYTEST_CURRENT_TEST")}


def shutdown(timeout_s: float = 30.0) -> None:
    """End this process's server, if one runs (it ends by itself when this process exits)."""
    global _server
    with _server_lock:
        server, _server = _server, None
    if server is not None:
        _stop(server, timeout_s)


def _stop(server: _Server, timeout_s: float = 30.0) -> None:
    server.proc.stdin.close()  # end of its requests: it returns
    try:
        server.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:  # pragma: no cover - it returns at its next poll
        server.proc.kill()
        server.proc.wait()
    server.proc.stdout.close()


class Worker:
    """A forked worker, with what `processes.kill_sessions` and `exit_status` read of a child."""

    def __init__(self, server: _Server, pid: int):
        self._server = server
        self.pid = pid
        self._status: int | None = None

    @property
    def returncode(self) -> int | None:
        """The exit status (negative: killed by that signal), or None while it runs. The worker is
        not reaped until `wait`, so its pid (its session's id) is not reused before the sweep."""
        if self._status is None:
            with self._server.lock:
                self._server.drain()
                self._status = self._server.statuses.get(self.pid)
                if self._status is None and not self._server.alive():  # its death signal killed the worker
                    self._status = -signal.SIGKILL
        return self._status

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the exit (at most `timeout` seconds), then let the server reap the worker."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None and (deadline is None or time.monotonic() < deadline):
            time.sleep(POLL_S)
        if self._status is not None and self._server.alive():
            with self._server.lock:
                if self._server.statuses.pop(self.pid, None) is not None:
                    self._server.request({"release": self.pid})
        return self._status


def start(argv: list[str], *, env: dict[str, str], log: Path) -> Worker:
    """Fork `python -m zeroplan.measure.worker ARGV` from the server, its output in `log`."""
    server = running_server()
    with server.lock:
        pid = server.request({"start": {"argv": argv, "env": env, "log": str(log)}}, answer="started")
    return Worker(server, pid)


# -- the server ----------------------------------------------------------------------------------


def serve() -> None:  # pragma: no cover - runs in the server process
    import zeroplan.measure.server_preload  # noqa: F401 - torch, once for every worker
    from zeroplan.measure.processes import unreaped_status

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's; the server ends with it
    requests, replies = sys.stdin.buffer.fileno(), sys.stdout.buffer

    def reply(message: dict) -> None:
        replies.write(json.dumps(message).encode() + b"\n")
        replies.flush()

    running: set[int] = set()
    pending = b""
    reply({"ready": os.getpid()})
    while True:
        ready, _, _ = select.select([requests], [], [], POLL_S)
        if ready:
            chunk = os.read(requests, 65536)
            if not chunk:
                return  # the launcher is gone; the workers' death signal ends them
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                message = json.loads(line)
                if "start" in message:
                    server_pid = os.getpid()
                    pid = os.fork()
                    if pid == 0:
                        _enter_worker(**message["start"], server_pid=server_pid)
                    running.add(pid)
                    reply({"started": pid})
                elif "release" in message:
                    os.waitpid(message["release"], 0)
        for pid in list(running):  # exited, not reaped until the launcher releases it
            status = unreaped_status(pid)
            if status is not None:
                running.discard(pid)
                reply({"exited": pid, "status": status})


def _enter_worker(argv: list[str], env: dict[str, str], log: str, server_pid: int) -> None:  # pragma: no cover
    """The forked worker: set up as a fresh process would be, run the worker program, exit.
    Its stdin and stdout, the server's pipes to the launcher, are replaced by /dev/null and the log."""
    status = 1
    try:
        from zeroplan.measure.processes import die_with_parent

        os.setsid()
        die_with_parent(server_pid)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.environ.clear()
        os.environ.update(env)
        threads = env.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            import torch

            torch.set_num_threads(int(threads))
        from zeroplan.measure import worker

        sys.argv = [worker.__file__, *argv]  # as `python -m zeroplan.measure.worker ARGV` sees it
        worker.main(argv)
        status = 0
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001 - a fresh Python would print it and exit 1
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status)  # never back into the server's loop


atexit.register(shutdown)  # the launcher ends its server as it exits, rather than leave it to read the end of its pipe

if __name__ == "__main__":
    serve()

"""DeepSpeed's JIT-built C++ ops: which ones a run needs, whether they are built, and building
them once, in one process, before the workers start (so the build is not part of their timeout).

DeepSpeed compiles an op the first time it is used (deepspeed/ops/op_builder/builder.py,
`OpBuilder.load` -> `jit_load` -> torch.utils.cpp_extension.load): with TORCH_EXTENSIONS_DIR set,
ninja builds in TORCH_EXTENSIONS_DIR/<op name>/ under the lock file `lock` there
(torch/utils/cpp_extension.py, `_get_build_directory` and `_jit_compile`) and leaves
<op name>.so there. Ops installed prebuilt with DeepSpeed (`installed_ops`) are not built.

    python -m zeroplan.measure.deepspeed_build deepspeed_shm_comm cpu_adam

builds the named ops into `ops_dir()` the same way (.ci/deepspeed_cache.sh runs it).
The build child reports one line per op on stdout: "waiting NAME" (another zeroplan builds it now),
"cleaned NAME" (it removed what a build that was stopped left), "compiling NAME" (before a build),
then "ready NAME"; or "skip NAME" (not used by this accelerator).

What a stopped build leaves, and who removes it:
- zeroplan's builds of one op take turns under `flock` on BUILD_LOCK, which the kernel releases when
  its holder dies, so a killed build never keeps the next one waiting; torch's own `lock` (a file
  that exists while a build runs) left by a killed build is removed once no process holds it
  (`processes.remove_stale_lock`);
- an op is built when its .so is the one ninja's log records (`built`): a build killed before its
  link, or during it, leaves objects and maybe a partial .so, which the next build removes first;
- the child runs in a session of its own with TMPDIR in its run folder (gcc's cc*.s files,
  DeepSpeed's tmp*/test.c probes); when the command dies, even by SIGKILL, the child is sent
  SIGTERM (PR_SET_PDEATHSIG) and kills its session, compilers included, and removes its lock
  (`processes.end_session`); the run folder is removed by the command, or by the next run when the
  command was killed outright (`processes.remove_dead_run_folders`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from zeroplan.errors import MeasureError
from zeroplan.measure.processes import (
    end_session,
    exit_status,
    kill_sessions,
    last_line,
    lock_holders,
    remove_dead_run_folders,
    remove_stale_lock,
    run_folder,
    spawn,
)
from zeroplan.spec.training import Offload, TrainingSpec

MODULE = "zeroplan.measure.deepspeed_build"  # __name__ is __main__ under python -m
EXTENSIONS_ENV = "ZEROPLAN_TORCH_EXTENSIONS_DIR"
"""Where DeepSpeed's JIT-built ops are cached; else TORCH_EXTENSIONS_DIR; else ~/.cache/zeroplan."""
POLL_S = 0.5  # while a build runs: how often to read its report
LOCK_CHECK_S = 5.0  # and how often to look for a lock left by a build that died (a scan of /proc)
BUILD_LOCK = "zeroplan-build.lock"  # flock'ed by the zeroplan build of the op in its folder (module docstring)
TORCH_LOCK = "lock"  # torch's FileBaton (cpp_extension.py `_jit_compile`)


def _chosen_by() -> str | None:
    """The variable that chose `extensions_dir()`, None for the default."""
    return next((name for name in (EXTENSIONS_ENV, "TORCH_EXTENSIONS_DIR") if os.environ.get(name)), None)


def extensions_dir() -> Path:
    """The kept folder for DeepSpeed's JIT ops, one subfolder per environment (`ops_dir`)."""
    chosen = _chosen_by()
    return Path(os.environ[chosen]).expanduser() if chosen else Path.home() / ".cache" / "zeroplan" / "torch_extensions"


def usable_ops_dir() -> Path:
    """`ops_dir()`, made if missing and checked writable (torch writes its lock and ninja its files
    there even when every op is built). Raises MeasureError naming the variable that chose it."""
    folder = ops_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        where = f"{error.strerror or error}" + (f": {error.filename}" if error.filename else "")
        variable = _chosen_by()
        if variable is None:
            raise MeasureError(f"{EXTENSIONS_ENV}: DeepSpeed's ops are built in {extensions_dir()} by default, which "
                               f"cannot be used ({where}); set {EXTENSIONS_ENV} to a folder you can write to") from None
        raise MeasureError(f"{variable}: {os.environ[variable]} cannot hold DeepSpeed's built ops ({where}); set it to a "
                           f"folder you can write to, or unset it") from None
    return folder


def ops_dir() -> Path:
    """The TORCH_EXTENSIONS_DIR of this environment: extensions_dir()/py311-torch2.13.0-ds0.19.8-<venv hash>.

    Two environments sharing one build folder rebuild each other's ops at every run (ninja sees
    other include paths), inside the workers and their timeout; torch's own default folder is
    per Python and accelerator only (cpp_extension.py, `_get_build_directory`)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "none"

    venv = hashlib.sha1(os.path.realpath(sys.prefix).encode()).hexdigest()[:8]
    key = f"py{sys.version_info.major}{sys.version_info.minor}-torch{installed('torch')}-ds{installed('deepspeed')}-{venv}"
    return extensions_dir() / key


def torch_env() -> dict[str, str]:
    """What a process that loads DeepSpeed's ops needs in its environment: the build folder for
    torch, and the kept folder pinned (else the first would become the root of its own subfolder)."""
    return {EXTENSIONS_ENV: str(extensions_dir()), "TORCH_EXTENSIONS_DIR": str(ops_dir())}


@dataclass(frozen=True)
class Op:
    builder: str  # DeepSpeed's op builder class (deepspeed/ops/op_builder/cpu/*.py)
    label: str  # as the user is told
    duration: str  # a cold build on 2 idle cores


# key: the builder's NAME, which is also its build folder and .so name
OPS = {
    "deepspeed_shm_comm": Op("ShareMemCommBuilder", "shared-memory comm op", "about 35 s"),
    "cpu_adam": Op("CPUAdamBuilder", "cpu_adam", "about a minute"),
    "fused_adam": Op("FusedAdamBuilder", "fused_adam", "about a minute"),
    "cpu_lion": Op("CPULionBuilder", "cpu_lion", "about a minute"),
    "cpu_adagrad": Op("CPUAdagradBuilder", "cpu_adagrad", "about a minute"),
}


def ops_for(training: TrainingSpec, engine_config: dict | None, *, cuda: bool) -> tuple[str, ...]:
    """The JIT ops a DeepSpeed run of `training` (or of the user's `engine_config`) loads."""
    ops = [] if cuda else ["deepspeed_shm_comm"]  # deepspeed/comm/torch.py, build_shm_op: CPU accelerator only
    if engine_config is None:  # deepspeed_engine.deepspeed_config: torch's AdamW on CPU without offload
        kind, offload = training.optimizer.value, training.offload_optimizer != Offload.NONE
        torch_adam = not cuda and not offload
    else:
        section = engine_config.get("optimizer") or {}
        kind = str(section.get("type", "")).lower()
        torch_adam = bool((section.get("params") or {}).get("torch_adam", False))
        device = ((engine_config.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device")
        offload = device in ("cpu", "nvme")
    # runtime/engine.py: get_optimizer_configuration (Adam), _configure_basic_optimizer (Lion, Adagrad)
    if kind in ("adam", "adamw") and not torch_adam:
        ops.append("cpu_adam" if offload else "fused_adam")
    elif kind in ("lion", "adagrad") and offload:
        ops.append(f"cpu_{kind}")
    return tuple(ops)


def built(name: str, folder: Path) -> bool:
    """Whether op `name` is built in `folder`: its .so is the file ninja's log recorded when the link
    finished (ninja appends an output's line, with its mtime in ns, once its command succeeded: ninja's
    src/build_log.cc `RecordCommand`), not an object or a partial .so of a build that was stopped."""
    library = folder / name / f"{name}.so"
    try:
        mtime_ns = library.stat().st_mtime_ns
        log = (folder / name / ".ninja_log").read_text(errors="replace").splitlines()
    except OSError:
        return False
    if not log or not log[0].startswith("# ninja log v"):
        return False
    for line in log[1:]:  # start, end, mtime, output, command hash (tab-separated; v5 and later)
        fields = line.split("\t")
        if len(fields) >= 5 and fields[3] == library.name and fields[2] == str(mtime_ns):
            return True
    return False


def clean_half_built(op_folder: Path) -> bool:
    """Remove what a stopped build of the op left in `op_folder` (objects, a partial .so, ninja's files),
    keeping the locks; to be called holding the op's BUILD_LOCK, with torch's lock free. True if there was any."""
    leftovers = [path for path in op_folder.iterdir() if path.name not in (BUILD_LOCK, TORCH_LOCK)]
    for path in leftovers:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return bool(leftovers)


def announcement(name: str) -> str:
    op = OPS[name]
    return f"compiling DeepSpeed's {op.label}, {op.duration}, once (kept in {extensions_dir()}; not part of the timeout)"


def build_ahead(
    names: tuple[str, ...], *, env: dict[str, str], announce: Callable[[str], None], timeout_s: float | None = None,
    progress: Callable[[str, float], None] | None = None,
) -> None:
    """Build the ops of `names` that are not built yet, in one child process, saying so through
    `announce` before each build starts (and through `progress`, if given, the op's label and the
    seconds so far, every POLL_S). Raises MeasureError when the build folder cannot be used, or
    a build fails or outlasts `timeout_s`; on any exit (Ctrl-C too) the child and its compilers are
    killed, its lock removed and its temporary files with it; if this process is killed outright, the
    child does the same for itself, and the next run removes the run folder (module docstring)."""
    folder = usable_ops_dir()
    missing = tuple(name for name in names if not built(name, folder))
    if not missing:
        return
    remove_dead_run_folders()  # what builds and runs killed outright left in the temporary directory
    workdir = run_folder("build")
    proc = None
    try:
        log_path, tmp = workdir / "build.log", workdir / "tmp"
        tmp.mkdir()
        env = env | torch_env() | {"TMPDIR": str(tmp)}  # gcc's cc*.s, DeepSpeed's tmp*/test.c probes
        with open(log_path, "wb") as log:
            proc = spawn([sys.executable, "-m", MODULE, "--child", *missing], env=env, stdout=subprocess.PIPE, stderr=log,
                         death_signal=signal.SIGTERM)  # caught: it ends its compilers too (_build_here)
        current = _follow(proc, missing, folder, announce, timeout_s, progress)
        while (status := exit_status(proc)) is None:  # its report closed as it exited
            time.sleep(0.02)
        if status != 0:
            detail = last_line(log_path) or f"exit status {status}"
            raise MeasureError(f"building DeepSpeed's {OPS[current].label} failed: {detail}")
    finally:
        if proc is not None:
            kill_sessions([proc])
            proc.stdout.close()
        remove_stale_locks(missing)
        shutil.rmtree(workdir, ignore_errors=True)


def _follow(proc: subprocess.Popen, missing: tuple[str, ...], folder: Path, announce, timeout_s: float | None,
            progress: Callable[[str, float], None] | None = None) -> str:
    """Read the child's report until it exits; return the op it was at last."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    next_sweep = time.monotonic() + LOCK_CHECK_S
    current, pending = missing[0], b""
    started = None  # when the op being compiled started (not while waiting for another process's build)
    while True:
        ready, _, _ = select.select([proc.stdout], [], [], POLL_S)
        chunk = os.read(proc.stdout.fileno(), 4096) if ready else b""
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            event, current = line.decode().split()[:2]
            if event != "compiling":
                started = None
            if event == "waiting":
                announce(f"waiting for another zeroplan's build of DeepSpeed's {OPS[current].label} (in {folder / current})")
            elif event == "cleaned":
                announce(f"removed the unfinished build of DeepSpeed's {OPS[current].label} that a stopped run left "
                         f"in {folder / current}")
            elif event == "compiling":
                announce(announcement(current))
                started = time.monotonic()
        if ready and not chunk:  # end of file: the child exited
            return current
        if progress is not None and started is not None:
            progress(OPS[current].label if current in OPS else current, time.monotonic() - started)
        if deadline is not None and time.monotonic() > deadline:
            raise MeasureError(f"building DeepSpeed's {OPS[current].label} took more than {timeout_s:g} s; stopped it")
        if time.monotonic() > next_sweep:  # a build that died elsewhere must not keep this one waiting
            remove_stale_locks(missing)
            next_sweep = time.monotonic() + LOCK_CHECK_S


def remove_stale_locks(names: tuple[str, ...]) -> None:
    """Remove the build locks of `names` whose owner is gone (a build killed with its command)."""
    folder = ops_dir()
    for name in names:
        remove_stale_lock(folder / name / TORCH_LOCK)


def main(argv: list[str] | None = None) -> None:
    """`OP...`: build them in a child process, as `measure` does; `--child OP...`: be that child."""
    args = sys.argv[1:] if argv is None else argv
    child = args[:1] == ["--child"]
    names = args[1:] if child else args
    unknown = [name for name in names if name not in OPS]
    if unknown or not names:
        sys.exit(f"usage: python -m {MODULE} OP...; known ops: {', '.join(OPS)}")
    if not child:
        from zeroplan.measure.processes import child_env

        env = child_env(None)  # the child picks DeepSpeed's accelerator
        started = time.monotonic()
        try:
            build_ahead(tuple(names), env=env, announce=print)
        except MeasureError as error:
            sys.exit(str(error))
        except KeyboardInterrupt:
            sys.exit("interrupted; the build was stopped")
        print(f"{', '.join(names)} ready in {ops_dir()} ({time.monotonic() - started:.0f} s)")
        return
    _build_here(names)


def _build_here(names: list[str]) -> None:
    """The child: build each op not built yet with DeepSpeed's own builder, one zeroplan build of an op
    at a time, reporting on stdout (module docstring)."""
    os.environ.update(torch_env())
    folder = ops_dir()
    # the command's death (PR_SET_PDEATHSIG, set at spawn) ends ninja and the compilers, and frees torch's lock
    end_session(signal.SIGTERM, cleanup=lambda: _release_torch_locks(folder, names))
    report = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # DeepSpeed and torch print to stdout: into the log, out of the report
    folder.mkdir(parents=True, exist_ok=True)
    builders = _Builders()
    for name in names:
        op_folder = folder / name
        op_folder.mkdir(exist_ok=True)
        with _build_lock(op_folder, lambda: print(f"waiting {name}", file=report)):
            if built(name, folder):  # by the zeroplan build this one waited for
                print(f"ready {name}", file=report)
                continue
            builder = builders.get(name)
            if builder is None:
                print(f"skip {name}", file=report)  # not used by this accelerator
                continue
            if builders.prebuilt(builder):
                print(f"ready {name}", file=report)  # prebuilt: OpBuilder.load imports it
                continue
            while remove_stale_lock(op_folder / TORCH_LOCK) == "held":  # a build outside zeroplan's: a worker's
                time.sleep(POLL_S)
            if not built(name, folder):
                if clean_half_built(op_folder):
                    print(f"cleaned {name}", file=report)
                print(f"compiling {name}", file=report)
            builder.load(verbose=False)
        print(f"ready {name}", file=report)


@contextlib.contextmanager
def _build_lock(op_folder: Path, on_wait: Callable[[], None]) -> Iterator[None]:
    """Hold the op's BUILD_LOCK (flock: the kernel releases it when its holder dies); `on_wait` is
    called first if another build holds it."""
    import fcntl

    fd = os.open(op_folder / BUILD_LOCK, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by ninja (PEP 446)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _release_torch_locks(folder: Path, names: list[str]) -> None:
    """Remove torch's lock of each op this process holds (its build was stopped: nothing will finish it)."""
    for name in names:
        lock = folder / name / TORCH_LOCK
        if os.getpid() in (lock_holders(lock) or ()):
            lock.unlink(missing_ok=True)


class _Builders:
    """DeepSpeed's op builders, imported only when an op must be built (an op already built needs no torch)."""

    def __init__(self) -> None:
        self._accelerator = None

    def get(self, name: str):
        """The builder of op `name`, None where this accelerator does not use it."""
        if self._accelerator is None:
            import torch

            if not torch.cuda.is_available():
                os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is imported
            from deepspeed.accelerator import get_accelerator

            self._accelerator = get_accelerator()
        builder = self._accelerator.create_op_builder(OPS[name].builder)
        return builder if builder is not None and builder.is_compatible(False) else None

    def prebuilt(self, builder) -> bool:
        from deepspeed.git_version_info import accelerator_name, installed_ops

        return bool(installed_ops.get(builder.name, False)) and accelerator_name == self._accelerator._name


if __name__ == "__main__":
    main()

"""DeepSpeed's JIT-built C++ ops: which ones a run needs, whether they are built, and building
them once, in one process, before the workers start (so the build is not part of their timeout).

DeepSpeed compiles an op the first time it is used (deepspeed/ops/op_builder/builder.py,
`OpBuilder.load` -> `jit_load` -> torch.utils.cpp_extension.load): with TORCH_EXTENSIONS_DIR set,
ninja builds in TORCH_EXTENSIONS_DIR/<op name>/ under the lock file `lock` there
(torch/utils/cpp_extension.py, `_get_build_directory` and `_jit_compile`) and leaves
<op name>.so there. Ops installed prebuilt with DeepSpeed (`installed_ops`) are not built.

    python -m zeroplan.measure.deepspeed_build deepspeed_shm_comm cpu_adam

builds the named ops into `ops_dir()` the same way (.ci/deepspeed_cache.sh runs it).
The build child reports one line per op on stdout: "waiting NAME" (another process holds its
build lock) and "compiling NAME" (before a build), then "ready NAME"; or "skip NAME" (not used
by this accelerator).
"""

from __future__ import annotations

import hashlib
import os
import select
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from zeroplan.errors import MeasureError
from zeroplan.measure.processes import exit_status, kill_sessions, last_line, remove_stale_lock, spawn
from zeroplan.spec.training import Offload, TrainingSpec

MODULE = "zeroplan.measure.deepspeed_build"  # __name__ is __main__ under python -m
EXTENSIONS_ENV = "ZEROPLAN_TORCH_EXTENSIONS_DIR"
"""Where DeepSpeed's JIT-built ops are cached; else TORCH_EXTENSIONS_DIR; else ~/.cache/zeroplan."""
POLL_S = 0.5  # while a build runs: how often to read its report
LOCK_CHECK_S = 5.0  # and how often to look for a lock left by a build that died (a scan of /proc)


def extensions_dir() -> Path:
    """The kept folder for DeepSpeed's JIT ops, one subfolder per environment (`ops_dir`)."""
    chosen = os.environ.get(EXTENSIONS_ENV) or os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(chosen).expanduser() if chosen else Path.home() / ".cache" / "zeroplan" / "torch_extensions"


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
    return (folder / name / f"{name}.so").is_file()


def announcement(name: str) -> str:
    op = OPS[name]
    return f"compiling DeepSpeed's {op.label}, {op.duration}, once (kept in {extensions_dir()}; not part of the timeout)"


def build_ahead(
    names: tuple[str, ...], *, env: dict[str, str], announce: Callable[[str], None], timeout_s: float | None = None,
    progress: Callable[[str, float], None] | None = None,
) -> None:
    """Build the ops of `names` that are not built yet, in one child process, saying so through
    `announce` before each build starts (and through `progress`, if given, the op's label and the
    seconds so far, every POLL_S). Raises MeasureError when a build fails or outlasts `timeout_s`;
    on any exit (Ctrl-C too) the child and its compilers are killed and its lock removed."""
    folder = ops_dir()
    missing = tuple(name for name in names if not built(name, folder))
    if not missing:
        return
    env = env | torch_env()
    with tempfile.TemporaryDirectory(prefix="zeroplan-build-") as tmp:
        log_path = Path(tmp) / "build.log"
        proc = None
        try:
            with open(log_path, "wb") as log:
                proc = spawn([sys.executable, "-m", MODULE, "--child", *missing], env=env, stdout=subprocess.PIPE, stderr=log)
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
                announce(f"waiting for another process's build of DeepSpeed's {OPS[current].label} ({folder / current / 'lock'})")
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
        remove_stale_lock(folder / name / "lock")


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
    """The child: load (building if needed) each op with DeepSpeed's own builder, reporting on stdout."""
    report = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # DeepSpeed and torch print to stdout: into the log, out of the report
    os.environ.update(torch_env())
    folder = ops_dir()
    folder.mkdir(parents=True, exist_ok=True)
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is imported
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops

    for name in names:
        builder = get_accelerator().create_op_builder(OPS[name].builder)
        if builder is None or not builder.is_compatible(False):
            print(f"skip {name}", file=report)  # not used by this accelerator
            continue
        if installed_ops.get(builder.name, False) and accelerator_name == get_accelerator()._name:
            print(f"ready {name}", file=report)  # prebuilt: OpBuilder.load imports it
            continue
        if remove_stale_lock(folder / name / "lock") == "held":
            print(f"waiting {name}", file=report)  # torch waits for the lock (cpp_extension._jit_compile)
        if not built(name, folder):
            print(f"compiling {name}", file=report)
        builder.load(verbose=False)
        print(f"ready {name}", file=report)


if __name__ == "__main__":
    main()

"""DeepSpeed's JIT-built C++ ops: which ones a run needs, whether they are built, and building
them once, in one process, before the workers start (so the build is not part of their timeout).

DeepSpeed compiles an op the first time it is used (deepspeed/ops/op_builder/builder.py,
`OpBuilder.load` -> `jit_load` -> torch.utils.cpp_extension.load): with TORCH_EXTENSIONS_DIR set,
ninja builds in TORCH_EXTENSIONS_DIR/<op name>/ under the lock file `lock` there
(torch/utils/cpp_extension.py, `_get_build_directory` and `_jit_compile`) and leaves
<op name>.so there. Ops installed prebuilt with DeepSpeed (`installed_ops`) are not built.

    python -m zeroplan.measure.deepspeed_build deepspeed_shm_comm cpu_adam

builds the named ops into `extensions_dir()` (.ci/deepspeed_cache.sh runs it), reporting one line
per op on stdout: "compiling NAME", "built NAME", "ready NAME" (nothing to build) or "skip NAME"
(not used by this accelerator).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from zeroplan.errors import MeasureError
from zeroplan.measure.processes import remove_stale_lock, spawn
from zeroplan.spec.training import Offload, TrainingSpec

EXTENSIONS_ENV = "ZEROPLAN_TORCH_EXTENSIONS_DIR"
"""Where DeepSpeed's JIT-built ops are cached; else TORCH_EXTENSIONS_DIR; else ~/.cache/zeroplan."""
POLL_S = 0.5  # while a build runs: how often to look for a lock left by a build that died


def extensions_dir() -> Path:
    """The kept build folder for DeepSpeed's JIT ops (torch.utils.cpp_extension reads TORCH_EXTENSIONS_DIR)."""
    chosen = os.environ.get(EXTENSIONS_ENV) or os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(chosen).expanduser() if chosen else Path.home() / ".cache" / "zeroplan" / "torch_extensions"


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


def announcement(name: str, folder: Path) -> str:
    op = OPS[name]
    return f"compiling DeepSpeed's {op.label}, {op.duration}, once (kept in {folder}; not part of the timeout)"


def build_ahead(
    names: tuple[str, ...], *, env: dict[str, str], workdir: Path, announce: Callable[[str], None],
    started: list[subprocess.Popen],
) -> None:
    """Build the ops of `names` that are not built yet, in one child process (appended to
    `started`, for the caller to kill), saying so before each build starts. Raises MeasureError
    when a build fails."""
    folder = extensions_dir()
    missing = [name for name in names if not built(name, folder)]
    if not missing:
        return
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(env, TORCH_EXTENSIONS_DIR=str(folder))
    log_path = workdir / "build.log"
    with open(log_path, "wb") as log:
        proc = spawn([sys.executable, "-m", __name__, *missing], env=env, stdout=subprocess.PIPE, stderr=log)
    started.append(proc)
    current = missing[0]
    lines = b""
    while True:
        ready, _, _ = select.select([proc.stdout], [], [], POLL_S)
        chunk = os.read(proc.stdout.fileno(), 4096) if ready else b""
        lines += chunk
        while b"\n" in lines:
            line, lines = lines.split(b"\n", 1)
            event, name = line.decode().split()[:2]
            current = name
            if event == "compiling":
                announce(announcement(current, folder))
        if ready and not chunk:  # end of file: the child exited
            break
        remove_stale_locks(tuple(missing))  # a build that died elsewhere must not keep this one waiting
    if proc.wait() != 0:
        detail = _last_line(log_path) or f"exit status {proc.returncode}"
        raise MeasureError(f"building DeepSpeed's {OPS[current].label} failed: {detail}")


def remove_stale_locks(names: tuple[str, ...]) -> None:
    """Remove the build locks of `names` whose owner is gone (a build killed with its command)."""
    folder = extensions_dir()
    for name in names:
        remove_stale_lock(folder / name / "lock")


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


def main(argv: list[str] | None = None) -> None:
    names = sys.argv[1:] if argv is None else argv
    unknown = [name for name in names if name not in OPS]
    if unknown:
        sys.exit(f"unknown op {unknown[0]}; known: {', '.join(OPS)}")
    report = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # DeepSpeed and torch print to stdout: into stderr, out of the report
    folder = extensions_dir()
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCH_EXTENSIONS_DIR"] = str(folder)
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is imported
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops

    for name in names:
        builder = get_accelerator().create_op_builder(OPS[name].builder)
        if builder is None or not builder.is_compatible(False):
            print(f"skip {name}", file=report)
            continue
        if installed_ops.get(builder.name, False) and accelerator_name == get_accelerator()._name:
            print(f"ready {name}", file=report)  # prebuilt: OpBuilder.load imports it
            continue
        remove_stale_lock(folder / name / "lock")
        fresh = not built(name, folder)
        if fresh:
            print(f"compiling {name}", file=report)
        started = time.monotonic()
        builder.load(verbose=False)
        print(f"built {name} in {time.monotonic() - started:.0f} s" if fresh else f"ready {name}", file=report)


if __name__ == "__main__":
    main()

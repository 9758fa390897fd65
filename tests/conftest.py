"""Session fixtures shared by test modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILD_BOUND_S = 1800  # a cold cpu_adam build takes 1-3 minutes on 2 busy cores; a hang exceeds this


@pytest.fixture(scope="session")
def deepspeed_ops():
    """`deepspeed_ops(*names)` builds DeepSpeed's JIT ops `names` (zeroplan.measure.deepspeed_build.OPS)
    into the kept folder once per session, ahead of the tests that time their runs."""
    pytest.importorskip("deepspeed")
    from zeroplan.measure.launcher import _child_env
    from zeroplan.measure.processes import kill_sessions, spawn

    done: set[str] = set()

    def ensure(*names: str) -> None:
        wanted = [name for name in names if name not in done]
        if not wanted:
            return
        proc = spawn([sys.executable, "-m", "zeroplan.measure.deepspeed_build", *wanted], env=_child_env("gloo"),
                     stdout=subprocess.PIPE, cwd=ROOT)
        try:
            out, _ = proc.communicate(timeout=BUILD_BOUND_S)
        finally:
            kill_sessions([proc])
        if proc.returncode != 0:
            pytest.fail(f"building {', '.join(wanted)} failed (exit {proc.returncode}): {out.decode()[-2000:]}")
        done.update(wanted)

    return ensure

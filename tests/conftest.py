"""Session fixtures shared by test modules."""

from __future__ import annotations

import importlib.util

import pytest

BUILD_BOUND_S = 1800  # a cold cpu_adam build takes 1-3 minutes on 2 busy cores; a hang exceeds this


@pytest.fixture(scope="session")
def deepspeed_ops():
    """`deepspeed_ops(*names)` builds DeepSpeed's JIT ops `names` (zeroplan.measure.deepspeed_build.OPS)
    into the kept folder once per session, ahead of the tests that time their runs."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs deepspeed")
    from zeroplan.measure.deepspeed_build import build_ahead
    from zeroplan.measure.processes import child_env

    def ensure(*names: str) -> None:
        build_ahead(names, env=child_env("gloo"), announce=print, timeout_s=BUILD_BOUND_S)

    return ensure

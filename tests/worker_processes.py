"""Test helper: record the worker processes the launcher starts, and tell whether one still runs."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from types import ModuleType

import pytest

SPAWNED: list[subprocess.Popen] = []  # every worker any test of this session started


class RecordingPopen(subprocess.Popen):
    """subprocess.Popen that remembers each process it starts (patched into the launcher)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        SPAWNED.append(self)


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone: it holds no memory and does no work)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def workers_recorded(launcher: ModuleType) -> Iterator[None]:
    """Record the workers `launcher` starts; afterwards, some must have started and none may be left."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launcher.subprocess, "Popen", RecordingPopen)
        yield
    assert SPAWNED, "no worker was started"
    assert [p.pid for p in SPAWNED if alive(p.pid)] == []

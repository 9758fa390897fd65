"""Test helper: record the worker processes the launcher starts, and tell whether one still runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType

import pytest

SPAWNED: list = []  # every worker any test of this session started (worker_server.Worker, or a Popen)


def recording(start):
    """The launcher's `start_worker` (or `spawn`), remembering each worker it starts (patched into the launcher)."""

    def start_and_record(*args, **kwargs):
        worker = start(*args, **kwargs)
        SPAWNED.append(worker)
        return worker

    return start_and_record


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
        patch.setattr(launcher, "start_worker", recording(launcher.start_worker))
        patch.setattr(launcher, "spawn", recording(launcher.spawn))  # fresh workers (fork_workers=False)
        yield
    assert SPAWNED, "no worker was started"
    assert [p.pid for p in SPAWNED if alive(p.pid)] == []

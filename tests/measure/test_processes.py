"""A worker dies with its launcher even when the launcher dies between the fork and the worker's
prctl(PR_SET_PDEATHSIG): prctl(2) only signals for a parent that dies after the call, so the child
checks that its parent is still the launcher that spawned it (measure/processes.py `die_with_parent`).
The race was seen in CI: a SIGKILLed launcher left one worker of two running."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys

import pytest

from zeroplan.measure.processes import die_with_parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _run(launcher_pid: int) -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.DEVNULL,
                             preexec_fn=functools.partial(die_with_parent, launcher_pid))
    return child.wait(timeout=60)


def test_a_child_whose_launcher_is_already_gone_kills_itself_before_it_runs():
    # a pid that is not the child's parent stands for a launcher that died and was reaped
    assert _run(launcher_pid=os.getpid() + 10**6) == -signal.SIGKILL


def test_a_child_of_a_live_launcher_runs():
    assert _run(launcher_pid=os.getpid()) == 0

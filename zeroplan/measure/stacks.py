"""Where a stuck worker is: its Python stacks, asked for when a measurement times out.

A worker registers `faulthandler` on SIGUSR1 (`dump_on_signal`), which writes every thread's stack
to the worker's stderr (its log) from a C signal handler, so it answers even while its main thread
waits inside a collective. On a timeout the launcher signals the ranks still running
(`request`), waits for their dumps, and names the innermost frame of each (`innermost_frame`):
a hang is then reported with the call each rank was stuck in, not as a bare timeout.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

SIGNAL = signal.SIGUSR1
HEADER = "(most recent call first):"  # faulthandler's line before each thread's frames
WAIT_S = 2.0  # how long the launcher waits for the dumps; faulthandler writes within milliseconds
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<function>\S+)')


def dump_on_signal() -> None:
    """In a worker: dump every thread's stack to stderr when the launcher sends SIGNAL."""
    import faulthandler

    faulthandler.register(SIGNAL, all_threads=True)


def request(pids: list[int], logs: list[Path]) -> dict[int, str]:
    """Signal `pids` (running workers, each writing to its log in `logs`) to dump their stacks;
    return each one's dump (the log text written after the signal), waiting at most WAIT_S."""
    sizes = [_size(log) for log in logs]
    for pid in pids:
        try:
            os.kill(pid, SIGNAL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + WAIT_S
    dumps: dict[int, str] = {}
    while time.monotonic() < deadline and len(dumps) < len(pids):
        time.sleep(0.05)
        for index, (log, size) in enumerate(zip(logs, sizes)):
            text = _tail(log, size)
            if HEADER in text and index not in dumps:
                time.sleep(0.05)  # the rest of the dump follows the header within the same handler
                dumps[index] = _tail(log, size)
    return dumps


def innermost_frame(dump: str) -> str:
    """`function (file:line)` of the innermost frame of the thread that took the signal (the
    "Current thread", the main thread of a worker), or of the first thread listed; "" if none."""
    blocks = dump.split("\n\n")
    current = [block for block in blocks if block.lstrip().startswith("Current thread")]
    for block in current + blocks:
        match = _FRAME.search(block)
        if match:
            where = Path(match["file"])
            short = "/".join(where.parts[-3:])
            return f"{match['function']} ({short}:{match['line']})"
    return ""


def _size(log: Path) -> int:
    try:
        return log.stat().st_size
    except OSError:
        return 0


def _tail(log: Path, offset: int) -> str:
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""

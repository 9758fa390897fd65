"""Progress on stderr for the long commands: a status line redrawn in place when stderr is a terminal,
nothing when it is not (a log file or a pipe gets the commands' lines, never the redraws).

`zeroplan validate` shows its rows with it, `zeroplan measure` each rank's phase and DeepSpeed's
builds (`MeasureProgress`, the launcher's `Progress`: zeroplan/measure/launcher.py).
"""

from __future__ import annotations

import sys

import click

_REDRAW = "\r\033[K"  # back to the start of the line, and clear it


def bar(done: int, total: int, width: int = 20) -> str:
    """[#####...............] 3/12"""
    filled = width * done // total if total else width
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


class StatusLine:
    """One line at the bottom of a terminal's stderr, redrawn by `show`; `line` prints a line that stays
    (over the status line, which the next `show` draws again below it)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.shown = False

    def show(self, text: str) -> None:
        if self.tty:
            click.echo(_REDRAW + text, nl=False, err=True)
            self.shown = True

    def line(self, text: str) -> None:
        click.echo((_REDRAW if self.tty else "") + text, err=True)
        self.shown = False

    def clear(self) -> None:
        if self.shown:
            click.echo(_REDRAW, nl=False, err=True)
            self.shown = False


class MeasureProgress:
    """`zeroplan measure`'s progress (the launcher's `Progress`): DeepSpeed's build with its seconds, then
    each rank's step and phase, with a bar of the slowest rank's phases (3 per step)."""

    PHASES = ("forward", "backward", "optimizer_step")

    def __init__(self, status: StatusLine, steps: int):
        self.status, self.steps = status, steps

    def announce(self, message: str) -> None:
        """The build's announcement: a line that stays, as without a terminal."""
        self.status.line(message)

    def build(self, label: str, seconds: float) -> None:
        self.status.show(f"building DeepSpeed's {label}: {seconds:.0f} s")

    def ranks(self, phases: dict[int, tuple[int, str]]) -> None:
        done = min(self._done(step, phase) for step, phase in phases.values())
        step = max(step for step, _ in phases.values())
        where = "set-up" if step == 0 else f"step {step}/{self.steps}"
        self.status.show(f"{bar(done, 3 * self.steps)} {where}: {self._ranks_text(phases)}")

    def _done(self, step: int, phase: str) -> int:
        """Phases of the steps finished before this one, and of this step before `phase`."""
        return 0 if step == 0 else 3 * (step - 1) + (self.PHASES.index(phase) if phase in self.PHASES else 0)

    def _ranks_text(self, phases: dict[int, tuple[int, str]]) -> str:
        if len(phases) <= 8:
            return ", ".join(f"rank {rank} {phase}" for rank, (_, phase) in sorted(phases.items()))
        groups: dict[tuple[int, str], int] = {}
        for at in phases.values():
            groups[at] = groups.get(at, 0) + 1
        behind_first = sorted(groups.items(), key=lambda item: (item[0][0], self._done(*item[0])))
        return ", ".join(f"{count} ranks at {phase} of step {step}" for (step, phase), count in behind_first)

"""Activation checkpointing policies the planner searches: a mode, and for full checkpointing every Nth block."""

from __future__ import annotations

from typing import NamedTuple

from zeroplan.errors import FieldError
from zeroplan.spec.training import Checkpointing


class Policy(NamedTuple):
    """An activation checkpointing policy: a mode, and for full checkpointing every Nth block only."""

    mode: Checkpointing
    every: int | None = None

    @property
    def label(self) -> str:
        return f"every-{self.every}" if self.every else self.mode.value

    @classmethod
    def parse(cls, text: str) -> Policy:
        """'none', 'selective', 'op', 'full' or 'every-N' (full checkpointing of every Nth block)."""
        if text.startswith("every-"):
            try:
                every = int(text.removeprefix("every-"))
            except ValueError:
                every = 0
            if every < 1:
                raise FieldError("checkpointing", f"cannot read {text!r}; write every-N with N at least 1, e.g. every-2")
            return cls(Checkpointing.FULL, every)
        try:
            return cls(Checkpointing(text))
        except ValueError:
            choices = ", ".join(mode.value for mode in Checkpointing)
            raise FieldError("checkpointing", f"unknown policy {text!r}; use {choices} or every-N") from None


DEFAULT_POLICIES = (Policy(Checkpointing.NONE), Policy(Checkpointing.SELECTIVE), Policy(Checkpointing.OP),
                    Policy(Checkpointing.FULL), Policy(Checkpointing.FULL, 2))
"""Every policy the estimator models: torchtitan's per-op policy (its default), and full checkpointing of
every block and of every other block (torchtitan selective_ac_option = 2)."""

"""Phases of a rank's measurement: what the worker's loop and a program's hooks (programs/) open and
close around the accounting, one PhaseResult per (step, phase)."""

from __future__ import annotations

import contextlib


class PhaseRecorder:
    """Opens and closes accounting phases and keeps one PhaseResult per (step, phase)."""

    def __init__(self, accounting, probe, on_phase=None):
        self.accounting, self.probe = accounting, probe
        self.on_phase = on_phase  # told (step, phase) as each opens: the launcher's progress (worker.py)
        self.phases = {}  # (step, phase) -> PhaseResult, in the order first seen
        self.open = None
        self.closed = []  # (step, phase, device stats) of every phase closed, in order: `rebuild`

    @contextlib.contextmanager
    def phase(self, step: int, name: str, *, default_category: str, born_as: str | None = None):
        self.switch(step, name, default_category=default_category, born_as=born_as)
        try:
            yield
        finally:
            self.close()

    def switch(self, step: int, name: str, *, default_category: str, born_as: str | None = None) -> None:
        """End the open phase, if any, and open (step, name): for a loop that someone else owns
        (the Hugging Face Trainer), where phases are marked from hooks and cannot be `with` blocks."""
        self.close()
        self.probe.begin_phase()
        self.accounting.begin_phase(name, default_category=default_category, born_as=born_as)
        self.open = (step, name)
        if self.on_phase is not None:
            self.on_phase(step, name)

    def close(self) -> None:
        """End the open phase (also when it raised: an out-of-memory result keeps how far it got)."""
        if self.open is None:
            return
        step, name = self.open
        self.open = None
        memory = self.accounting.end_phase()
        device = self.probe.end_phase()
        self.closed.append((step, name, device))
        self._store(step, name, memory, device)

    def rebuild(self, memories) -> None:
        """The phases again from `memories`, one per phase closed, in order: an accounting that knows its
        figures only once the run has ended (allocations.py `AllocatorAccounting.finish`)."""
        self.phases = {}
        for (step, name, device), memory in zip(self.closed, memories):
            self._store(step, name, memory, device)

    def _store(self, step: int, name: str, memory, device) -> None:
        from zeroplan.measure.result import PhaseResult

        new = PhaseResult(step, name, memory.live_bytes, memory.peak_bytes, memory.peak_categories, device,
                          memory.adapter_params_bytes)
        old = self.phases.get((step, name))
        if old is not None:  # another micro-batch of the same step: keep the higher peak
            if old.peak_bytes >= new.peak_bytes:
                new.peak_bytes, new.categories = old.peak_bytes, old.categories
                new.adapter_params_bytes = old.adapter_params_bytes
            if old.device and new.device:
                new.device = {k: max(old.device.get(k, 0), v) if "peak" in k or k.startswith("num_") else v for k, v in new.device.items()}
        self.phases[(step, name)] = new

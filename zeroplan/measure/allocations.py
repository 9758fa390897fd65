"""Live bytes as the allocator reports them: the accounting of programs a dispatch mode changes.

`accounting.TensorAccounting` counts from a TorchDispatchMode, and torch.compile does not run its compiled code
while such a mode is active: Dynamo runs the frame's eager ops instead (seen with torch 2.13.0: under a mode
the compiled block's aten ops, gelu and mm, reach the mode one by one), so a mode would measure the eager
program. This one watches the allocator instead: torch.profiler's memory records (`profile_memory=True`) hold
every allocation and free of the CPU allocator (c10 `reportMemoryUsageToProfiler`), with its address and size,
whoever makes it: inductor's buffers, aten's outputs, a kernel's scratch space. One profile covers the whole
run; the phases are `record_function` ranges in it, and the records are read when the run ends (`finish`).

Categories at a phase's peak: the allocations live at the peak that are still live at the phase's end take
the category the runner gives their storage then (`tensors_by_category`, asked once per phase end); the rest
take the category given at birth (`born_as`), else the phase's default, as TensorAccounting's rules do.
Allocations made before the profile started (torch's own) are never freed in its records; none is counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from zeroplan.estimate.result import TENSOR_CATEGORIES
from zeroplan.measure.accounting import PhaseMemory, storages_of
from zeroplan.measure.engines.common import ENGINE_CATEGORIES

_MARK = "zeroplan phase "


@dataclass
class _Phase:
    name: str
    default_category: str
    born_as: str | None
    categories_at_end: dict[int, str] = field(default_factory=dict)  # storage address -> category, at the end


class AllocatorAccounting:
    """The accounting interface of `TensorAccounting` (begin_phase, end_phase, set_classifier), counted from the
    allocator's records. `end_phase` returns a placeholder; `finish()`, after the context has exited, gives every
    phase's PhaseMemory in order."""

    def __init__(self, device: torch.device | None = None):
        self.device = torch.device(device or "cpu")  # the run's device: only its allocator's records count
        self._classifier: Callable[[], dict[str, list[torch.Tensor]]] | None = None
        self._phases: list[_Phase] = []
        self._marker = None
        self._profile = None
        self.classifications = 0

    def __enter__(self) -> "AllocatorAccounting":
        from torch.profiler import ProfilerActivity, profile

        # the calling thread's records only (profile_all_threads drops the memory records, torch 2.13.0): frees on
        # other threads (gloo's, of a collective's tensors) are not seen, so compiled CPU runs are measured on one rank
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._profile = profile(activities=activities, profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._marker is not None:
            self._marker.__exit__(None, None, None)
            self._marker = None
        self._profile.__exit__(*exc)

    def set_classifier(self, classifier) -> None:
        self._classifier = classifier

    def begin_phase(self, name: str, *, default_category: str, born_as: str | None = None) -> None:
        for category in (default_category, born_as):
            if category is not None and category not in TENSOR_CATEGORIES:
                raise ValueError(f"category {category!r} is not one of {TENSOR_CATEGORIES}")
        self._phases.append(_Phase(name, default_category, born_as))
        self._marker = torch.profiler.record_function(f"{_MARK}{len(self._phases) - 1}")
        self._marker.__enter__()

    def end_phase(self) -> PhaseMemory:
        phase = self._phases[-1]
        phase.categories_at_end = self._classify()
        self._marker.__exit__(None, None, None)
        self._marker = None
        return PhaseMemory(phase.name, 0, 0, dict.fromkeys(TENSOR_CATEGORIES, 0))

    def _classify(self) -> dict[int, str]:
        """Storage address -> the first category the runner names it under (ENGINE_CATEGORIES' order)."""
        if self._classifier is None:
            return {}
        self.classifications += 1
        by_category = self._classifier()
        found: dict[int, str] = {}
        for name in ENGINE_CATEGORIES:
            for tensor in by_category.get(name, ()):
                if tensor is None:
                    continue
                for storage in storages_of(tensor):
                    if storage.nbytes():
                        found.setdefault(storage.data_ptr(), name)
        return found

    def finish(self) -> list[PhaseMemory]:
        """Every phase's memory, in the order begun: live bytes at its end, its peak, categories at the peak."""
        events, ranges = _records(self._profile, self.device)
        live: dict[int, tuple[int, int]] = {}  # address -> (bytes, index of the phase it was born in, or -1)
        current = 0
        results = []
        cursor = 0
        for index, phase in enumerate(self._phases):
            start, end = ranges[index]
            while cursor < len(events) and events[cursor][0] < start:  # between phases
                current = _apply(live, events[cursor], current, -1)
                cursor += 1
            start_bytes = peak = current
            at_peak = dict(live)
            while cursor < len(events) and events[cursor][0] <= end:
                current = _apply(live, events[cursor], current, index)
                if current > peak:
                    peak, at_peak = current, dict(live)
                cursor += 1
            totals = dict.fromkeys(TENSOR_CATEGORIES, 0)
            for address, (size, born) in at_peak.items():
                category = phase.categories_at_end.get(address) if live.get(address) == (size, born) else None
                if category is None:  # a birth category holds in every later phase too (TensorAccounting's `born_as`)
                    category = (self._phases[born].born_as if born >= 0 else None) or phase.default_category
                totals[category] += size
            results.append(PhaseMemory(phase.name, current, peak, totals, start_bytes))
        return results


def _apply(live: dict[int, tuple[int, int]], event: tuple[int, int, int], current: int, phase: int) -> int:
    _, address, size = event
    if size > 0:
        live[address] = (size, phase)
        return current + size
    known = live.pop(address, None)
    return current - known[0] if known is not None else current  # a block from before the profile: never counted


def _records(profile, device: torch.device) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """(time, address, bytes: negative for a free) of every record of `device`'s allocator, in time order; and
    each phase's (start, end) time, by its index."""
    events: list[tuple[int, int, int]] = []
    ranges: dict[int, tuple[int, int]] = {}
    stack = list(profile.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        fields = node.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation":
            if fields.device.type == device.type:
                events.append((node.start_time_ns, fields.ptr, fields.alloc_size))
        elif node.name.startswith(_MARK):
            ranges[int(node.name[len(_MARK):])] = (node.start_time_ns, node.end_time_ns)
        stack.extend(node.children)
    events.sort(key=lambda event: (event[0], event[2] > 0))  # at one instant, frees before allocations
    return events, [ranges[index] for index in sorted(ranges)]

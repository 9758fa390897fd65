"""The estimate's ledger: every byte live at each phase's largest moment, as named terms.

An estimate computed in naming mode (estimate/terms.py) carries, for every (step, phase), the
terms live at that phase's largest moment: name, category, bytes and source. The phase totals, the
peak and every per-category figure are folds of these terms (`fold`), never adjusted afterwards.
`allocation_events` reads the ledger in program order as the allocations and frees between those
moments: what a caching-allocator model replays.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from zeroplan.estimate.result import CATEGORY_NAMES, CategoryBytes, NodeBytes, Phase, PhaseBytes, Step
from zeroplan.estimate.terms import UNNAMED, naming_on, parts_of, source_of


class Term(NamedTuple):
    """One named allocation live at a moment."""

    name: str
    category: str  # one of result.CATEGORY_NAMES
    bytes: int
    source: str  # the upstream file and function, or the docs section, it comes from


class Moment(NamedTuple):
    """The terms live at the largest moment of one phase of one step, and at the moments of that phase the
    engine names after it (`passing`, in program order): the replay reads them (estimate/device/estimate.py
    `ledger_events`); the phase's figures are its largest moment's alone."""

    step: Step
    phase: Phase
    terms: tuple[Term, ...]
    passing: tuple[tuple[Term, ...], ...] = ()

    def categories(self) -> CategoryBytes:
        by_category = dict.fromkeys(CATEGORY_NAMES, 0)
        for term in self.terms:
            by_category[term.category] += term.bytes
        return CategoryBytes(**by_category)


def terms_of(category: str, value: int) -> list[Term]:
    """The terms of one category's bytes. A negative part is what a formula subtracts: memory freed of
    another term (a block's backward freeing its MLP product); it is taken off the category's largest
    term, so that every term is an allocation and they still add up to the category."""
    parts = parts_of(value)
    freed = sum(part for name, part in parts.items() if part < 0 and name != UNNAMED)
    if freed:
        parts = {name: part for name, part in parts.items() if part > 0 or name == UNNAMED}
        named_parts = [name for name in parts if name != UNNAMED]
        if named_parts:
            largest = max(named_parts, key=parts.__getitem__)
            parts[largest] += freed
        else:
            parts[UNNAMED] = parts.get(UNNAMED, 0) + freed
    return [Term(name, category, part, source_of(name)) for name, part in parts.items() if part]


def _terms(phase: PhaseBytes) -> tuple[Term, ...]:
    terms: list[Term] = []
    for category, value in zip(CATEGORY_NAMES, phase.categories):
        terms += terms_of(category, value)
    return tuple(terms)


def moment_of(phase: PhaseBytes, passing: Sequence[PhaseBytes] = ()) -> Moment:
    """The terms of one phase whose categories hold named byte counts, with those of the moments after its peak
    (`passing`: the same step and phase, in program order)."""
    return Moment(phase.step, phase.phase, _terms(phase), tuple(_terms(after) for after in passing))


class Folded(NamedTuple):
    phases: tuple[PhaseBytes, ...]  # bytes as ints, each phase the fold of its moment's terms
    ledger: tuple[Moment, ...] | None  # None in the planner's fast mode: no names were kept
    per_node: NodeBytes


def fold(phases: Sequence[PhaseBytes], per_node: NodeBytes, passing: Sequence[PhaseBytes] = ()) -> Folded:
    """Phases (and per-node bytes) whose values may be named byte counts, as ints and their ledger; `passing`, the
    moments after a phase's peak that the replay reads (engines/common.py EngineEstimate), go to their phase's moment."""
    if not naming_on():
        return Folded(tuple(phases), None, per_node)
    ledger = tuple(moment_of(phase, [after for after in passing if (after.step, after.phase) == (phase.step, phase.phase)])
                   for phase in phases)
    folded = tuple(PhaseBytes(moment.step, moment.phase, moment.categories()) for moment in ledger)
    return Folded(folded, ledger, NodeBytes(*(int(value) for value in per_node)))


class AllocationEvent(NamedTuple):
    """One allocation or free between two moments of the ledger, in program order."""

    moment: int  # index of the moment (phase) it leads into
    allocate: bool  # False: a free
    name: str
    category: str
    bytes: int


def allocation_events(ledger: Iterable[Moment]) -> list[AllocationEvent]:
    """The ledger as allocations and frees: a term that grows between two moments allocates the
    difference, one that shrinks frees the most recent part of it (stack order, as backward frees
    what forward saved last), one that disappears frees it."""
    live: dict[tuple[str, str], int] = {}
    events: list[AllocationEvent] = []
    for index, moment in enumerate(ledger):
        for terms in (moment.terms, *moment.passing):
            now = {(term.name, term.category): term.bytes for term in terms if term.bytes > 0}
            for key, held in live.items():
                after = now.get(key, 0)
                if after < held:
                    events.append(AllocationEvent(index, False, key[0], key[1], held - after))
            for key, after in now.items():
                held = live.get(key, 0)
                if after > held:
                    events.append(AllocationEvent(index, True, key[0], key[1], after - held))
            live = now
    return events

"""Byte counts that remember what they are made of: the estimate's ledger is built from them.

Every quantity of bytes the estimator computes is made by `named(name, bytes)`. In the planner's
fast mode (the default) that is the int itself, and the engines' arithmetic runs on ints. Inside
`naming()` it is a `Terms`: a sum of named parts that adds, scales, compares and floors like an int,
so the same arithmetic, unchanged, yields each phase's bytes *and* the allocations they are made of.
`zeroplan.estimate.estimate` runs in naming mode; `fit` (the planner's fit check) in fast mode;
tests hold the two equal.

Each name is registered once, with the source it comes from (`register`): the upstream file and
function, or the docs/engines section that derives it. The estimate's JSON `terms` and
`--explain` print them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar

UNNAMED = "unnamed"  # bytes no registered name accounts for (a test keeps every catalogue estimate free of them)

_NAMING: ContextVar[bool] = ContextVar("zeroplan_naming", default=False)
_SOURCES: dict[str, str] = {}


PIECES = ("tensors", "activations", "logits", "whole", "states", "step")
"""What a term is made of, as the caching allocator sees it (estimate/device/estimate.py splits each term's
allocations so): tensors the size of the rank's parameters (per-parameter states, gradients, gathered
parameters), tensors the size of the micro-batch's residual stream (what forward saves), tensors the size of
the micro-batch's fp32 logits or loss chunk (the loss's upcast, log_softmax output and gradients), one buffer
(a flat partition, a bucket, a collective's input or output), the optimizer's states of one flat partition:
one tensor per state, each the partition's size (exp_avg, exp_avg_sq), or the optimizer step's temporaries over
one flat partition: as many tensors of its size as the step kernel holds at once (for-loop: two; foreach: one)."""
_PIECES: dict[str, str] = {}


def register(sources: Mapping[str, str], pieces: str = "tensors") -> Mapping[str, str]:
    """Declare term names, their sources and what they are made of (`PIECES`; module level, once per
    name); returns `sources`."""
    if pieces not in PIECES:
        raise ValueError(f"pieces: {pieces!r} is not one of {', '.join(PIECES)}")
    for name, source in sources.items():
        known = _SOURCES.get(name)
        if known is not None and (known != source or _PIECES[name] != pieces):
            raise ValueError(f"term {name!r} is registered twice, differently")
        _SOURCES[name] = source
        _PIECES[name] = pieces
    return sources


def source_of(name: str) -> str:
    """The registered source of term `name` ("" for an unregistered one)."""
    return _SOURCES.get(name, "")


def pieces_of(name: str) -> str:
    """What term `name` is made of (`PIECES`; tensors for an unregistered one)."""
    return _PIECES.get(name, "tensors")


def naming_on() -> bool:
    return _NAMING.get()


@contextmanager
def naming() -> Iterator[None]:
    """Compute with `Terms` inside this block (the caches keep the two modes apart: caches.memo)."""
    token = _NAMING.set(True)
    try:
        yield
    finally:
        _NAMING.reset(token)


def named(name: str, value: int) -> int:
    """`value` bytes under `name`: the int itself, or in naming mode a one-part `Terms`."""
    if not _NAMING.get() or isinstance(value, Terms):
        return value
    return Terms({name: value}) if value else 0


def relabel(name: str, value: int) -> int:
    """`value` (an int or a `Terms` of any parts) as one part named `name`, its total unchanged."""
    if not _NAMING.get():
        return value
    total = int(value)
    return Terms({name: total}) if total else 0


def parts_of(value: int) -> dict[str, int]:
    """The named parts of a byte count (`{UNNAMED: value}` for a plain int, none for zero)."""
    if isinstance(value, Terms):
        return {name: part for name, part in value.parts.items() if part}
    return {UNNAMED: value} if value else {}


def _parts(value: object) -> dict[str, int] | None:
    if isinstance(value, Terms):
        return value.parts
    if isinstance(value, int):
        return {UNNAMED: value} if value else {}
    return None


class Terms:
    """A sum of named byte counts. Arithmetic keeps the parts; comparisons, formatting and int()
    read the total. Floor division divides each part and gives the rounding to the largest, so the
    total is exactly what int arithmetic gives."""

    __slots__ = ("parts",)
    __hash__ = None  # type: ignore[assignment]  # compared by total, like the ints it stands for

    def __init__(self, parts: dict[str, int]):
        self.parts = parts

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def __int__(self) -> int:
        return self.total

    __index__ = __int__

    def __bool__(self) -> bool:
        return self.total != 0

    def __repr__(self) -> str:
        return f"Terms({self.total}: {self.parts})"

    def __format__(self, spec: str) -> str:
        return format(self.total, spec)

    def _combine(self, other: object, sign: int) -> Terms:
        theirs = _parts(other)
        if theirs is None:
            return NotImplemented
        parts = dict(self.parts)
        for name, value in theirs.items():
            parts[name] = parts.get(name, 0) + sign * value
        return Terms(parts)

    def __add__(self, other: object) -> Terms:
        return self._combine(other, 1)

    __radd__ = __add__

    def __sub__(self, other: object) -> Terms:
        return self._combine(other, -1)

    def __rsub__(self, other: object) -> Terms:
        return (-self)._combine(other, 1)

    def __neg__(self) -> Terms:
        return Terms({name: -value for name, value in self.parts.items()})

    def __pos__(self) -> Terms:
        return self

    def __mul__(self, factor: object) -> Terms:
        if isinstance(factor, Terms) or not isinstance(factor, int):
            return NotImplemented  # bytes times bytes means nothing; floats would lose exactness
        return Terms({name: value * factor for name, value in self.parts.items()})

    __rmul__ = __mul__

    def __floordiv__(self, divisor: object) -> Terms:
        if isinstance(divisor, Terms) or not isinstance(divisor, int):
            return NotImplemented
        total = self.total // divisor
        parts = {name: value // divisor for name, value in self.parts.items()}
        if parts:
            largest = max(parts, key=lambda name: abs(self.parts[name]))
            parts[largest] += total - sum(parts.values())
        return Terms(parts)

    def __truediv__(self, other: object) -> float:
        """A ratio, not bytes: the total over `other`."""
        return self.total / self._total_of(other)

    def __rtruediv__(self, other: object) -> float:
        return self._total_of(other) / self.total

    def _total_of(self, other: object) -> int | float:
        return other.total if isinstance(other, Terms) else other  # type: ignore[return-value]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Terms, int, float)):
            return self.total == self._total_of(other)
        return NotImplemented

    def __lt__(self, other: object) -> bool:
        return self.total < self._total_of(other)

    def __le__(self, other: object) -> bool:
        return self.total <= self._total_of(other)

    def __gt__(self, other: object) -> bool:
        return self.total > self._total_of(other)

    def __ge__(self, other: object) -> bool:
        return self.total >= self._total_of(other)

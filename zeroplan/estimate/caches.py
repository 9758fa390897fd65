"""The estimator's memo caches, all registered here so that `clear_all` forgets every one.

The planner evaluates one model thousands of times per plan, so what does not depend on the
micro-batch is kept between calls: `memo` for functions of hashable values (functools.lru_cache),
`IdentityCache` for values keyed by an object that is slow to hash (a pydantic spec, or
ModelFacts with every tensor of every group). Results never depend on a cache; `clear_all` exists
for benchmarks of a process's first plan and for tests that compare the cached path with a fresh
one.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from functools import lru_cache
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_REGISTERED: list[Any] = []  # lru_cache wrappers and IdentityCaches

MISSING = object()
"""What `IdentityCache.get` returns for an object it holds nothing for."""


def memo(maxsize: int | None) -> Callable[[F], F]:
    """functools.lru_cache(maxsize), registered for `clear_all`."""

    def decorate(function: F) -> F:
        cached = lru_cache(maxsize=maxsize)(function)
        _REGISTERED.append(cached)
        return cached  # type: ignore[return-value]

    return decorate


class IdentityCache:
    """Values keyed by an object's identity and a few hashable extras. Each entry holds its
    object, so that its id cannot be reused by another object while the entry exists; past
    `limit` entries the cache starts again empty."""

    def __init__(self, limit: int):
        self._entries: dict[tuple[int, Hashable], tuple[Any, Any]] = {}
        self._limit = limit
        _REGISTERED.append(self)

    def get(self, obj: Any, extra: Hashable = ()) -> Any:
        hit = self._entries.get((id(obj), extra))
        return hit[1] if hit is not None and hit[0] is obj else MISSING

    def put(self, obj: Any, extra: Hashable, value: Any) -> Any:
        if len(self._entries) >= self._limit:
            self._entries.clear()
        self._entries[(id(obj), extra)] = (obj, value)
        return value

    def cache_clear(self) -> None:
        self._entries.clear()


def clear_all() -> None:
    """Forget every registered cache: the next estimate runs as the first of a process does."""
    for cache in _REGISTERED:
        cache.cache_clear()

"""The estimator's memo caches, all registered here so that `clear_all` forgets every one.

The planner evaluates one model thousands of times per plan, so what does not depend on the
micro-batch is kept between calls (functools.lru_cache over hashable values: specs, `Setup`
records, and ModelFacts and layouts by identity). Results never depend on a cache; `clear_all`
exists for benchmarks of a process's first plan and for tests that compare the cached path with
a fresh one.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, wraps
from typing import Any, TypeVar

from zeroplan.estimate.terms import naming_on

F = TypeVar("F", bound=Callable[..., Any])

_REGISTERED: list[Any] = []  # lru_cache wrappers


def memo(maxsize: int | None) -> Callable[[F], F]:
    """functools.lru_cache(maxsize), registered for `clear_all`, with the naming mode in the key
    (estimate/terms.py: a result computed with named terms is not the planner's int, nor the reverse)."""

    def decorate(function: F) -> F:
        cached = lru_cache(maxsize=maxsize)(lambda naming, *args, **kwargs: function(*args, **kwargs))
        _REGISTERED.append(cached)

        @wraps(function)
        def keyed(*args: Any, **kwargs: Any) -> Any:
            return cached(naming_on(), *args, **kwargs)

        keyed.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        keyed.cache_info = cached.cache_info  # type: ignore[attr-defined]
        return keyed  # type: ignore[return-value]

    return decorate


def clear_all() -> None:
    """Forget every registered cache: the next estimate runs as the first of a process does."""
    for cache in _REGISTERED:
        cache.cache_clear()

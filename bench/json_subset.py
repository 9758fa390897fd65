"""Compare a new JSON document with an old one on the old one's keys only: a change that adds keys
(the estimate's `terms`, `ranks`) keeps every figure the old document had, and the checks of a
restructuring say so without rewriting their baselines."""

from __future__ import annotations

from typing import Any


def restricted(new: Any, old: Any) -> Any:
    """`new` with every dict cut to the keys `old` has at the same place (lists compared item by item)."""
    if isinstance(new, dict) and isinstance(old, dict):
        return {key: restricted(new[key], old[key]) if key in new else new.get(key) for key in old}
    if isinstance(new, list) and isinstance(old, list) and len(new) == len(old):
        return [restricted(item, before) for item, before in zip(new, old)]
    return new

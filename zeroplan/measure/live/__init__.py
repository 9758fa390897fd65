"""The estimate and the measurement inside a user's own training program (docs/api.md):

- `track(model, optimizer, ...)`: a plain loop or accelerate (tracker.py);
- `ZeroplanCallback(...)`: a transformers `TrainerCallback` over the same tracker (callback.py).

Both import torch (and the callback transformers) when first used: `import zeroplan` does not.
"""

from __future__ import annotations

from typing import Any

__all__ = ["track", "ZeroplanCallback", "Tracker"]


def __getattr__(name: str) -> Any:
    if name in ("track", "Tracker"):
        from zeroplan.measure.live import tracker

        return getattr(tracker, name)
    if name == "ZeroplanCallback":
        from zeroplan.measure.live.callback import ZeroplanCallback

        return ZeroplanCallback
    raise AttributeError(f"module 'zeroplan.measure.live' has no attribute {name!r}")

"""The real run's allocation stream through the caching allocator model: what a CUDA device would
have reserved for the storages this rank allocated (zeroplan/estimate/device/allocator.py).

On CPU there is no caching allocator, but the accounting saw every storage allocated and freed, in
order (measure/accounting.py); replaying that stream gives the reserved bytes the same program
would hold on a GPU, so the reserved model is exercised by every CPU measurement. On CUDA the same
replay sits beside the real `torch.cuda.memory_stats()`, which checks the model itself. The stream
has one stream (0): the accounting does not see CUDA streams, so record_stream delays are not in it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from zeroplan.errors import SpecError
from zeroplan.estimate.device.alloc_conf import settings_from_environment
from zeroplan.estimate.device.allocator import replay
from zeroplan.estimate.device.figures import tensor_peak


def replay_summary(events: Sequence, *, truncated: bool, environ: Mapping[str, str]) -> dict:
    """The replay's figures as the result JSON keeps them (`allocator_replay` of a rank)."""
    if truncated:
        return {"replayed": False, "events": len(events),
                "reason": "the run allocated more storages than the accounting keeps events for (event_limit)"}
    try:
        settings = settings_from_environment(environ)
    except SpecError as error:
        return {"replayed": False, "events": len(events), "reason": str(error)}
    result = replay(events, settings)
    return {
        "replayed": True,
        "events": len(events),
        "alloc_conf": settings.text,
        "stream_peak_bytes": tensor_peak(events),  # the tracker's own peak, sizes as allocated
        "allocated_peak_bytes": result.peak_allocated_bytes,  # max_memory_allocated: blocks rounded to 512 B
        "reserved_peak_bytes": result.peak_reserved_bytes,  # max_memory_reserved
        "reserved_end_bytes": result.reserved_end_bytes,
        "segments": result.segments,
        "inactive_split_peak_bytes": result.peak_inactive_split_bytes,
    }

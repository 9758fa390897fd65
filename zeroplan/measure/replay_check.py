"""The reserved model checked without a GPU (issue 22): for a grid row, the estimate's stream of allocations and
frees (its ledger read in program order: estimate/device/estimate.py `ledger_events`) and the real run's stream (the
accounting's, kept per rank as `allocator_replay`: measure/allocator_replay.py), each replayed through the same
caching-allocator model with the same settings. Where the two reserved peaks agree, the estimate's program order and
tensor sizes are what the allocator would see; where they part, the report says by how much."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReplayPair:
    """The reserved peak of the estimate's stream beside the real stream's (the highest over the ranks)."""

    estimated_reserved_bytes: int
    replayed_reserved_bytes: int | None  # None: the measurement kept no stream (`no_stream_because` says why)
    estimated_allocated_bytes: int
    replayed_allocated_bytes: int | None
    no_stream_because: str | None
    large_segment_bytes: int  # the replay settings' segment for requests under 10 MiB (kLargeBuffer by default)

    @property
    def difference_bytes(self) -> int | None:
        """Estimate's reserved peak less the real stream's: in segments' units (2 MiB small, 20 MiB large in
        c10/cuda/CUDACachingAllocator.cpp), which a tiny model's relative error hides."""
        if not self.replayed_reserved_bytes:
            return None
        return self.estimated_reserved_bytes - self.replayed_reserved_bytes

    @property
    def error(self) -> float | None:
        difference = self.difference_bytes
        return None if difference is None else difference / self.replayed_reserved_bytes


def replay_pair(estimate, measurement: Mapping[str, Any]) -> ReplayPair:
    """`estimate` (a MeshEstimate of the row) replayed rank kind by rank kind, its highest reserved peak, beside
    the highest reserved peak of the ranks' own streams in `measurement` (validate.py `summarize_measurement`)."""
    from zeroplan.estimate.device.alloc_conf import settings_from_environment
    from zeroplan.estimate.device.allocator import replay
    from zeroplan.estimate.device.estimate import ledger_events

    kept = [rank["allocator_replay"] for rank in measurement.get("ranks", ())
            if (rank.get("allocator_replay") or {}).get("replayed")]
    # the real stream was replayed with the run's PYTORCH_CUDA_ALLOC_CONF: the estimate's is replayed with the same
    settings = settings_from_environment({"PYTORCH_CUDA_ALLOC_CONF": kept[0]["alloc_conf"]} if kept else {})
    results = [replay(ledger_events(rank.estimate.ledger, rank.estimate.piece_sizes), settings) for rank in estimate.ranks]
    # a rank's record says why it kept no stream (a compiled run: measure/allocator_replay.py); a record without
    # the key was measured before measure kept streams
    reasons = [(rank.get("allocator_replay") or {}).get("reason") for rank in measurement.get("ranks", ())]
    why = None if kept else next((r for r in reasons if r), "measured before measure kept the stream")
    return ReplayPair(
        no_stream_because=why, large_segment_bytes=settings.large_segment_size_bytes,
        estimated_reserved_bytes=max(r.peak_reserved_bytes for r in results),
        replayed_reserved_bytes=max(k["reserved_peak_bytes"] for k in kept) if kept else None,
        estimated_allocated_bytes=max(r.peak_allocated_bytes for r in results),
        replayed_allocated_bytes=max(k["allocated_peak_bytes"] for k in kept) if kept else None,
    )

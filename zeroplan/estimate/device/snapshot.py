"""An allocation stream as PyTorch's memory viewer reads it: the dict `torch.cuda.memory._snapshot()` returns,
built from the caching allocator model's replay (allocator.py, `record_history=True`) and pickled with the
standard library, so that writing it needs no torch.

The format is torch 2.13's: torch/cuda/memory.py `_snapshot` documents it, torch/csrc/cuda/memory_snapshot.cpp
`_memory_snapshot_pickled` writes it, torch/cuda/_memory_viz.py (`stats`, `trace`, `segments`) and
pytorch.org/memory_viz (torch/utils/viz/MemoryViz.js, with its own unpickler) read it:
- `segments`: each segment at the end of the stream, with `device`, `address`, `total_size`, `allocated_size`,
  `active_size`, `requested_size`, `stream`, `segment_type` (small or large), `segment_pool_id` ((0, 0): the
  default pool), `is_expandable`, `frames` and its `blocks` in address order (`address`, `size`,
  `requested_size`, `state`: active_allocated, active_pending_free or inactive, `frames`);
- `device_traces`: one list per device of what the allocator did (`action`, `addr`, `size`, `stream`, `frames`;
  an `oom` has `device_free` instead of `addr`), oldest first;
- `allocator_settings`: PYTORCH_CUDA_ALLOC_CONF as the allocator read it.
A device here is a rank kind of an estimate (device i is `ranks[i]` of the JSON) or a rank of a measurement.
What the format has and a model cannot know is left out: `time_us` (no clock ran), and real stack frames:
a frame names what the bytes are instead (`frames_of`), innermost first as torch lists them.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from zeroplan.estimate.device.alloc_conf import AllocatorSettings
from zeroplan.estimate.device.allocator import AllocatorReplay, SegmentState
from zeroplan.estimate.device.estimate import ledger_events
from zeroplan.estimate.device.events import Alloc
from zeroplan.estimate.device.figures import WORKSPACE_KEY, DeviceFigures
from zeroplan.estimate.terms import source_of

Frame = dict[str, Any]  # {"filename": str, "line": int, "name": str}, as torch's symbolized frames


class DeviceHistory(NamedTuple):
    """One device of a snapshot: a replay with its history, and what each allocation is (its frames by key)."""

    replay: AllocatorReplay
    frames_of: Callable[[Hashable], list[Frame]]


def frame(filename: str, name: str, line: int = 0) -> Frame:
    """A frame as torch writes one (memory_snapshot.cpp `ivalue_symbolize`); line 0 where there is no line."""
    return {"filename": filename, "line": line, "name": name}


def _int64(value: int) -> int:
    """An unsigned setting as torch's snapshot stores it (`int64_t(...)`: SIZE_MAX becomes -1)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def allocator_settings(settings: AllocatorSettings) -> dict[str, Any]:
    """`allocator_settings` of the snapshot (memory_snapshot.cpp: the config metadata it reports)."""
    return {
        "PYTORCH_CUDA_ALLOC_CONF": settings.text,
        "max_split_size": _int64(settings.max_split_size_bytes),
        "garbage_collection_threshold": float(settings.garbage_collection_threshold),
        "expandable_segments": settings.expandable_segments,
        "pinned_num_register_threads": settings.pinned_num_register_threads,
        "pinned_use_cuda_host_register": settings.pinned_use_cuda_host_register,
        # one division count per power-of-two size interval from 1 MiB, keyed "1", "2", "4", ...
        "roundup_power2_divisions": {str(1 << i): divisions for i, divisions in enumerate(settings.roundup_power2_divisions)},
    }


def _segment(device: int, segment: SegmentState, frames_of: Callable[[Hashable], list[Frame]]) -> dict[str, Any]:
    blocks = [{"address": b.address, "size": b.size_bytes, "requested_size": b.requested_bytes, "state": b.state,
               "frames": frames_of(b.key) if b.key is not None else []} for b in segment.blocks]
    allocated = [b for b in segment.blocks if b.state == "active_allocated"]
    return {
        "device": device,
        "address": segment.address,
        "total_size": segment.size_bytes,
        "allocated_size": sum(b.size_bytes for b in allocated),
        "active_size": sum(b.size_bytes for b in segment.blocks if b.state != "inactive"),
        "requested_size": sum(b.requested_bytes for b in allocated),
        "stream": segment.stream,
        "segment_type": "small" if segment.small else "large",
        "segment_pool_id": (0, 0),
        "is_expandable": segment.expandable,
        "frames": [],
        "blocks": blocks,
    }


def _trace(replay: AllocatorReplay, frames_of: Callable[[Hashable], list[Frame]]) -> list[dict[str, Any]]:
    trace = []
    for entry in replay.history:
        where = "device_free" if entry.action == "oom" else "addr"
        trace.append({"action": entry.action, where: entry.address, "size": entry.size_bytes, "stream": entry.stream,
                      "frames": frames_of(entry.key) if entry.key is not None else []})
    return trace


def snapshot_of(devices: Mapping[int, DeviceHistory], settings: AllocatorSettings) -> dict[str, Any]:
    """The snapshot of `devices` (device index -> its replay, made with `record_history=True`), as
    `torch.cuda.memory._snapshot()` gives it."""
    count = max(devices, default=-1) + 1
    return {
        "segments": [_segment(index, segment, device.frames_of)
                     for index, device in sorted(devices.items()) for segment in device.replay.segments_at_end],
        "device_traces": [_trace(devices[i].replay, devices[i].frames_of) if i in devices else [] for i in range(count)],
        "allocator_settings": allocator_settings(settings),
    }


def merge_snapshots(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One snapshot of the devices of `parts` (each a snapshot of its own devices: a measurement's ranks)."""
    count = max((len(part["device_traces"]) for part in parts), default=0)
    traces: list[list] = [[] for _ in range(count)]
    for part in parts:
        for index, trace in enumerate(part["device_traces"]):
            traces[index] = traces[index] or trace
    return {"segments": [segment for part in parts for segment in part["segments"]], "device_traces": traces,
            "allocator_settings": parts[0]["allocator_settings"] if parts else {}}


def write_snapshot(path: str | Path, snapshot: dict[str, Any], field: str = "--snapshot") -> None:
    """Pickle `snapshot` to `path`, whole or not at all. Protocol 4 uses only the opcodes the viewer's
    unpickler reads (MemoryViz.js `unpickle`: protocols 2 to 4)."""
    from zeroplan.spec.files import write_atomic

    write_atomic(path, pickle.dumps(snapshot, protocol=4), field)


def estimate_frames(ledger: Sequence, events: Sequence, moments: Sequence[int], rank_kind: str,
                    workspaces: Sequence) -> Callable[[Hashable], list[Frame]]:
    """What each allocation of an estimate's stream is (estimate/device/estimate.py `ledger_events` keys them
    (term, category, piece)): innermost the term with its source as the file, then its category, then the moment
    of the step it was allocated for, on which rank kind; a cuBLAS workspace (figures.py) by its source."""
    born: dict[Hashable, int] = {}
    moment = -1
    for index, event in enumerate(events):
        while moment + 1 < len(moments) and moments[moment + 1] <= index:
            moment += 1
        if type(event) is Alloc:
            born[event.key] = moment
    cache: dict[Hashable, list[Frame]] = {}

    def frames_of(key: Hashable) -> list[Frame]:
        found = cache.get(key)
        if found is None:
            if key[0] == WORKSPACE_KEY:
                term = workspaces[key[1]]
                found = [frame(term.source, term.name), frame("allocated for", "the first matmul of its handle"),
                         frame("rank kind", rank_kind)]
            else:
                name, category = key[0], key[1]
                when = ledger[born[key]]
                found = [frame(source_of(name) or "unregistered", name), frame("category", category),
                         frame("allocated for", f"{when.step.value} {when.phase.value}"), frame("rank kind", rank_kind)]
            cache[key] = found
        return found

    return frames_of


def estimate_snapshot(result, figures: Mapping[str, DeviceFigures], settings: AllocatorSettings) -> dict[str, Any]:
    """The snapshot of an estimate (`result`: a MeshEstimate): device i is rank kind i (`ranks[i]` of the JSON),
    drawn from the replay behind its figures (`figures`: estimate.device_figures(..., record_history=True), so the
    trace is the stream that gave `per_gpu.allocated` and `reserved`; a rank that runs out of memory is drawn as
    what it would need, as its figures are)."""
    devices = {}
    for index, rank in enumerate(result.ranks):
        found = figures[rank.kind.label]
        moments: list[int] = []
        events = ledger_events(rank.estimate.ledger, rank.estimate.piece_sizes, moments)
        devices[index] = DeviceHistory(found.replay, estimate_frames(rank.estimate.ledger, events, moments,
                                                                     rank.kind.label, found.allocator_terms))
    return snapshot_of(devices, settings)

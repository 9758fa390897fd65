"""A measured rank's allocation stream for PyTorch's memory viewer: the storages the accounting saw allocated
and freed (measure/accounting.py), replayed through the caching allocator model with its history kept, as
`torch.cuda.memory._snapshot()` pickles it (zeroplan/estimate/device/snapshot.py); device i is rank i.

Each allocation is named by the phase of the step it was made in (the worker marks where each phase's events
begin as the recorder opens it). On CPU the segments are what a GPU's allocator would have made of this stream;
on CUDA they sit beside the real allocator's (measure's `allocator_replay` compares their peaks). A compiled run
is counted from the allocator's own records (allocations.py), which keep no stream: measure refuses to draw it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Hashable, Mapping, Sequence

from zeroplan.estimate.device.alloc_conf import settings_from_environment
from zeroplan.estimate.device.allocator import replay
from zeroplan.estimate.device.events import Alloc
from zeroplan.estimate.device.snapshot import DeviceHistory, Frame, frame, snapshot_of


def rank_snapshot(events: Sequence, marks: Sequence[tuple[int, int, str]], rank: int,
                  environ: Mapping[str, str]) -> dict:
    """The snapshot of one rank (device `rank`): `events` the accounting's Alloc/Free stream, `marks` (event index,
    step, phase) where each phase began, `environ` the rank's PYTORCH_CUDA_ALLOC_CONF."""
    settings = settings_from_environment(environ)
    starts = [index for index, _, _ in marks]
    born = {event.key: index for index, event in enumerate(events) if type(event) is Alloc}
    where = f"zeroplan measure, rank {rank}"

    def frames_of(key: Hashable) -> list[Frame]:
        index = born.get(key)
        at = bisect_right(starts, index) - 1 if index is not None else -1
        phase = f"step {marks[at][1]} {marks[at][2]}" if at >= 0 else "before the first phase"
        return [frame(where, f"storage {key[0]}"), frame("allocated in", phase)]

    history = DeviceHistory(replay(events, settings, record_history=True), frames_of)
    return snapshot_of({rank: history}, settings)

"""The allocation stream the allocator model replays: plain records, one per call the program makes.

The estimator (a ledger's terms in program order) and `zeroplan measure` (the storages a real run
allocated and freed, measure/accounting.py) both produce it. A key names one allocation; it may be
any hashable value (an int, a term's name) and must not be reused while that allocation is live.
Streams are small ints: 0 is the default (compute) stream; what another number stands for is the
producer's business (an all-gather stream, DeepSpeed's reduction stream).

- `Alloc(key, size_bytes, stream)`: `caching_allocator.malloc(size, stream)` (a storage of
  size_bytes made while `stream` is current); size 0 allocates nothing, as torch skips it.
- `Free(key)`: the storage's last reference is gone (`free(block)`).
- `RecordStream(key, stream)`: `tensor.record_stream(stream)`: the block is also used on `stream`,
  so its free waits for an event on that stream.
- `StreamSync(stream)`: everything queued on `stream` so far has finished (its events complete);
  blocks whose last use was there become free at the next allocation (`process_events`).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple, Union

DEFAULT_STREAM = 0


class Alloc(NamedTuple):
    key: Hashable
    size_bytes: int
    stream: int = DEFAULT_STREAM


class Free(NamedTuple):
    key: Hashable


class RecordStream(NamedTuple):
    key: Hashable
    stream: int


class StreamSync(NamedTuple):
    stream: int


Event = Union[Alloc, Free, RecordStream, StreamSync]

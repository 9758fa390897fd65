"""A model of torch 2.13's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, the `native`
backend): replay an allocation stream and get what `torch.cuda.memory_stats()` would report.

Every rule below names the function of CUDACachingAllocator.cpp it comes from (class
`DeviceCachingAllocator` unless said otherwise); docs/engines/allocator.md derives them and says
what is not modelled (CUDA graphs and private pools, IPC, the cudaMallocAsync backend, memory
fractions changed at run time). The constants are c10/core/AllocatorConfig.h's.

Memory the driver hands out: a cudaMalloc (or an expandable segment's page) succeeds while the
bytes reserved plus the request fit in `capacity_bytes`, the device memory left to the allocator
(the GPU's memory minus what lives outside it: estimate/device/outside.py). None: no limit.

What it did, step by step (`replay(..., record_history=True)`): the entries `torch.cuda.memory._record_memory_history()`
records (`record_trace` in CUDACachingAllocator.cpp: alloc, free_requested, free_completed, segment_alloc,
segment_free, segment_map, segment_unmap, oom), and the segments with their blocks at the end, as
`torch.cuda.memory._snapshot()` lists them (`snapshot`): what estimate/device/snapshot.py writes for
PyTorch's memory viewer.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, insort
from collections import defaultdict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from zeroplan.errors import SpecError
from zeroplan.estimate.device.alloc_conf import DEFAULT_SETTINGS, SIZE_MAX, AllocatorSettings
from zeroplan.estimate.device.events import Alloc, Event, Free, RecordStream, StreamSync

K_MIN_BLOCK = 512  # kMinBlockSize: every size is rounded to at least 512 bytes
K_SMALL_SIZE = 1 << 20  # kSmallSize: the largest "small" allocation, 1 MiB
K_SMALL_BUFFER = 2 << 20  # kSmallBuffer: small allocations are packed in 2 MiB segments
K_MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: requests below 10 MiB share a large segment
K_ROUND_LARGE = 2 << 20  # kRoundLarge: larger requests are rounded up to 2 MiB
_SHIFT = 40  # a free block's sort key: size << 40 | registration counter (the set's order)


def round_size(size: int, settings: AllocatorSettings = DEFAULT_SETTINGS) -> int:
    """`round_size`: 512-byte multiples, or the next power-of-two division (roundup_power2_divisions)."""
    if size < K_MIN_BLOCK:
        return K_MIN_BLOCK
    divisions = settings.divisions_for(size)
    if divisions > 1 and size > K_MIN_BLOCK * divisions:
        return _next_power2_division(size, divisions)
    return -(-size // K_MIN_BLOCK) * K_MIN_BLOCK


def _next_power2_division(size: int, divisions: int) -> int:
    """`roundup_power2_next_division`: 1200 with 4 divisions -> 1280 (1024, 1280, 1536, 1792)."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def allocation_size(size: int, settings: AllocatorSettings = DEFAULT_SETTINGS) -> int:
    """`get_allocation_size`: the segment a new cudaMalloc gets for a rounded request."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return settings.large_segment_size_bytes
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


class TraceEntry(NamedTuple):
    """One entry of the allocator's history (`TraceEntry` of CUDACachingAllocator.h, as `record_trace` fills it)."""

    action: str  # alloc, free_requested, free_completed, segment_alloc, segment_free, segment_map, segment_unmap, oom
    address: int  # the block's or segment's address; for oom the bytes the device had free (`device_free`)
    size_bytes: int  # alloc and frees: the size requested; segment actions: the bytes mapped or freed; oom: asked
    stream: int
    key: Hashable  # the allocation it serves: its own, or the one whose request made the segment (None: none)


class BlockState(NamedTuple):
    """One block of a segment at the end of the stream (`BlockInfo` of `snapshot()`)."""

    address: int
    size_bytes: int
    requested_bytes: int  # what the allocation asked for (0 for an inactive block)
    state: str  # active_allocated, active_pending_free (freed, waiting for another stream) or inactive
    key: Hashable  # the allocation (None for an inactive block)


class SegmentState(NamedTuple):
    """One segment at the end of the stream (`SegmentInfo` of `snapshot()`): a cudaMalloc, or one mapped range
    of an expandable segment, as `snapshot()` reports each contiguous mapped range of one."""

    address: int
    size_bytes: int
    stream: int
    small: bool  # the small pool's (segment_type "small"), else "large"
    expandable: bool
    blocks: tuple[BlockState, ...]  # in address order, covering the segment


@dataclass(frozen=True)
class AllocatorReplay:
    """What the allocator reports after a stream (`torch.cuda.memory_stats()` names in comments)."""

    peak_allocated_bytes: int  # allocated_bytes.all.peak = max_memory_allocated()
    peak_reserved_bytes: int  # reserved_bytes.all.peak = max_memory_reserved()
    allocated_end_bytes: int  # allocated_bytes.all.current
    reserved_end_bytes: int  # reserved_bytes.all.current
    segments: int  # segment.all.current (cudaMalloc segments), plus live expandable segments
    peak_inactive_split_bytes: int  # inactive_split_bytes.all.peak
    num_alloc_retries: int  # cudaMalloc failed, the cache was freed and the call retried
    num_ooms: int  # the retry failed too: torch raised OutOfMemoryError
    num_oom_rejections: int  # refused by throw_on_cudamalloc_oom before any cudaMalloc
    first_oom_event: int | None  # index of the first Alloc that ran out of memory (the run stops there)
    allocated_after: tuple[int, ...]  # per event: allocated bytes once it is done
    reserved_after: tuple[int, ...]  # per event: reserved bytes once it is done
    # with replay(..., record_history=True), else empty: what the allocator did, in order, and the segments
    # with their blocks once the stream is done
    history: tuple[TraceEntry, ...] = ()
    segments_at_end: tuple[SegmentState, ...] = ()

    @property
    def fits(self) -> bool:
        return self.first_oom_event is None


class _Segment:
    """An expandable segment (`ExpandableSegment`): one address range, mapped in pages."""

    __slots__ = ("base", "page", "size")

    def __init__(self, base: int, page: int, size: int):
        self.base, self.page, self.size = base, page, size


class _Block:
    __slots__ = ("size", "counter", "stream", "small", "ptr", "prev", "next", "allocated", "events",
                 "uses", "segment", "mapped", "gc_base", "requested", "key")

    def __init__(self, size, counter, stream, small, ptr, segment=None):
        self.size, self.counter, self.stream, self.small, self.ptr = size, counter, stream, small, ptr
        self.prev = self.next = None
        self.allocated, self.events, self.uses = False, 0, None
        self.segment, self.mapped, self.gc_base = segment, True, 0
        self.requested, self.key = 0, None  # Block::requested_size, and the allocation it serves

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class CachingAllocatorModel:
    """One device's `DeviceCachingAllocator`; feed it events with `apply`, read `stats()`."""

    def __init__(self, settings: AllocatorSettings = DEFAULT_SETTINGS, *, capacity_bytes: int | None = None,
                 device_total_bytes: int | None = None, history: list[TraceEntry] | None = None):
        if settings.backend != "native":
            raise SpecError(f"{settings.variable or 'PYTORCH_CUDA_ALLOC_CONF'}: backend:{settings.backend} "
                            "(cudaMallocAsync) is not modelled; only the native caching allocator is")
        self.settings = settings
        self.capacity = capacity_bytes
        total = self.device_total = device_total_bytes or capacity_bytes
        # `setMemoryFraction`: a fraction below 1 caps the allocator at fraction x total memory
        fraction = settings.per_process_memory_fraction
        self.allowed_max = int(fraction * total) if fraction < 1.0 and total is not None else None
        self.gc_on = self.allowed_max is not None and settings.garbage_collection_threshold > 0.0
        # ExpandableSegment(): address space for 1 1/8 of the GPU's memory
        self.address_space = (total + total // 8) if total is not None else 1 << 48
        self.es_active = settings.expandable_segments
        self.plain_rounding = not any(settings.roundup_power2_divisions)
        self.max_split = settings.max_split_size_bytes
        self.free_lists: defaultdict[tuple[int, bool], list[int]] = defaultdict(list)  # (stream, small) -> sorted keys
        self.free_blocks: dict[int, _Block] = {}  # key -> block
        self.unmapped: defaultdict[tuple[int, bool], list[int]] = defaultdict(list)  # (stream, small) -> sorted ptrs
        self.unmapped_blocks: dict[int, _Block] = {}
        self.live: dict[Hashable, _Block] = {}
        self.pending: dict[int, list[_Block]] = {}  # stream -> blocks waiting on an event there
        self.synced: dict[int, int] = {}  # stream -> how many of its pending events have completed
        self.gc_calls = {True: 0, False: 0}  # BlockPool::get_free_blocks_call_count (small, large)
        self.counter = -1  # registration_counter_global
        self.next_address = 1 << 30
        self.reserved = self.allocated = self.inactive_split = 0
        self.peak_reserved = self.peak_allocated = self.peak_inactive_split = 0
        self.cuda_segments = self.expandable_segments = 0
        self.retries = self.ooms = self.rejections = 0
        self.history = history  # `record_trace` appends here when given (`_record_memory_history`)
        self._key: Hashable = None  # the allocation being served (a segment made for it names it in the history)

    # -- the free-block sets (BlockPool::blocks, ordered by stream, size, registration counter) --
    def _insert(self, block: _Block) -> None:
        if self.gc_on:  # BlockPool::insert_into_blocks (the age counts only where GC can run)
            block.gc_base = self.gc_calls[block.small]
        key = block.size << _SHIFT | block.counter
        self.free_blocks[key] = block
        insort(self.free_lists[block.stream, block.small], key)

    def _remove(self, block: _Block) -> None:
        key = block.size << _SHIFT | block.counter
        keys = self.free_lists[(block.stream, block.small)]
        del keys[bisect_left(keys, key)]
        del self.free_blocks[key]

    def _insert_unmapped(self, block: _Block) -> None:
        self.unmapped_blocks[block.ptr] = block
        insort(self.unmapped[block.stream, block.small], block.ptr)

    def _remove_unmapped(self, block: _Block) -> None:
        ptrs = self.unmapped[(block.stream, block.small)]
        del ptrs[bisect_left(ptrs, block.ptr)]
        del self.unmapped_blocks[block.ptr]

    def _new_block(self, size, stream, small, ptr, segment=None) -> _Block:
        self.counter += 1  # Block::Block takes the next registration counter
        return _Block(size, self.counter, stream, small, ptr, segment)

    # -- statistics --
    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved

    def _split_bytes(self, delta: int) -> None:
        self.inactive_split += delta
        if self.inactive_split > self.peak_inactive_split:
            self.peak_inactive_split = self.inactive_split

    # -- malloc --
    def malloc(self, key: Hashable, size: int, stream: int) -> bool:
        """`malloc`; False when it ran out of memory (torch raises OutOfMemoryError there)."""
        if self.synced:
            self._process_events()
        requested = size
        if self.history is not None:
            self._key = key
        if self.plain_rounding:  # round_size without roundup_power2_divisions
            size = -(-size // K_MIN_BLOCK) * K_MIN_BLOCK or K_MIN_BLOCK
        else:
            size = round_size(size, self.settings)
        small = size <= K_SMALL_SIZE  # get_pool
        block = self._get_free_block(size, stream, small)
        if block is None:
            alloc_size = allocation_size(size, self.settings)
            if self.gc_on:
                self._garbage_collect()
            block, rejected = self._alloc_block(size, stream, small, alloc_size, retry=False)
            if block is None and not rejected:  # the retry chain: each alternative runs while none found
                if self._release_available_cached_blocks(size, stream, small):
                    block, rejected = self._alloc_block(size, stream, small, alloc_size, retry=False)
                if block is None:
                    self._release_cached_blocks()
                    block, rejected = self._alloc_block(size, stream, small, alloc_size, retry=True)
            if block is None:
                if not rejected:  # a rejection raises without counting an OOM
                    self.ooms += 1
                if self.history is not None:  # malloc's OOM entry: what the device had free, what was asked
                    limit = self.capacity if self.capacity is not None else self.allowed_max
                    free = 0 if limit is None else max(limit - self.reserved, 0)
                    self.history.append(TraceEntry("oom", free, requested, stream, key))
                return False
        block = self.live[key] = self._alloc_found_block(block, size, stream, small, self._should_split(block, size))
        block.requested, block.key = requested, key
        if self.history is not None:  # alloc_found_block: TraceEntry::ALLOC with the size asked for
            self.history.append(TraceEntry("alloc", block.ptr, requested, stream, key))
        return True

    def _should_split(self, block: _Block, size: int) -> bool:
        """`should_split`: small pool and expandable segments from 512 bytes left over; a large
        block only below max_split_size and with more than 1 MiB left over."""
        remaining = block.size - size
        if block.small or self.es_active:
            return remaining >= K_MIN_BLOCK
        return size < self.max_split and remaining > K_SMALL_SIZE

    def _get_free_block(self, size: int, stream: int, small: bool) -> _Block | None:
        """`get_free_block`: best fit, the smallest cached block of the stream's pool that holds
        `size`; an oversize block (>= max_split_size) only for an oversize request, and only if it
        is less than max_non_split_rounding_mb larger."""
        if self.gc_on:
            self.gc_calls[small] += 1
        keys = self.free_lists[stream, small]
        if not keys:
            return None
        i = bisect_left(keys, size << _SHIFT)
        if i == len(keys):
            return None
        found = self.free_blocks[keys[i]]
        if found.segment is not None:
            if self.es_active:  # best fit by the size an expandable block could grow to
                while i + 1 < len(keys) and found.segment is not None:
                    following = self.free_blocks[keys[i + 1]]
                    if _expandable_size(following) >= _expandable_size(found):
                        break
                    i, found = i + 1, following
            else:  # expandable segments were turned off: skip their blocks
                while found.segment is not None:
                    i += 1
                    if i == len(keys):
                        return None
                    found = self.free_blocks[keys[i]]
        if size < self.max_split <= found.size:
            return None
        if size >= self.max_split and found.size >= size + self.settings.max_non_split_rounding_bytes:
            return None
        self._remove(found)
        return found

    def _alloc_block(self, size, stream, small, alloc_size, *, retry) -> tuple[_Block | None, bool]:
        """`alloc_block`: a new segment from the driver (or mapped pages of an expandable segment);
        (None, False) when the driver has no room, (None, True) when throw_on_cudamalloc_oom refused."""
        if retry:
            self.retries += 1
        if self.allowed_max is not None and self.reserved + alloc_size > self.allowed_max:
            return None, False
        if self.settings.throw_on_cudamalloc_oom and self.device_total is not None \
                and self.reserved + alloc_size > self.settings.per_process_memory_fraction * self.device_total:
            self.rejections += 1  # reachable only at fraction 1 (below it the check above fails first)
            return None, True
        if self.es_active:
            return self._allocate_expandable(size, stream, small), False
        if self.capacity is not None and self.reserved + alloc_size > self.capacity:
            return None, False  # cudaMalloc: cudaErrorMemoryAllocation
        block = self._new_block(alloc_size, stream, small, self.next_address)
        self.next_address += alloc_size
        self.cuda_segments += 1
        self._reserve(alloc_size)
        if self.history is not None:  # alloc_block: TraceEntry::SEGMENT_ALLOC
            self.history.append(TraceEntry("segment_alloc", block.ptr, alloc_size, stream, self._key))
        return block, False

    def _alloc_found_block(self, block: _Block, size: int, stream: int, small: bool, split: bool) -> _Block:
        """`alloc_found_block`: split the remainder off into the pool, count the block allocated."""
        already_split = block.is_split()
        if split:
            remaining = block
            block = self._new_block(size, stream, small, remaining.ptr, remaining.segment)
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = remaining
            remaining.prev = block
            remaining.ptr += size
            remaining.size -= size
            self._insert(remaining)
            if remaining.segment is None:
                self._split_bytes(-block.size if already_split else remaining.size)
        elif already_split and block.segment is None:
            self._split_bytes(-block.size)
        block.allocated = True
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block

    # -- free --
    def free(self, key: Hashable) -> None:
        """`free`: back to the pool now, or once every other stream that used it is done with it."""
        block = self.live.pop(key, None)
        if block is None:
            return  # an allocation that never happened (size 0, or out of memory)
        block.allocated = False
        self.allocated -= block.size
        if self.history is not None:  # free: TraceEntry::FREE_REQUESTED
            self.history.append(TraceEntry("free_requested", block.ptr, block.requested, block.stream, key))
        if block.uses:  # insert_events: one event per stream that used the block
            for stream in block.uses:
                block.events += 1
                self.pending.setdefault(stream, []).append(block)
            block.uses = None
        else:
            self._free_block(block)

    def record_stream(self, key: Hashable, stream: int) -> None:
        """`recordStream`: a use on another stream than the allocation's."""
        block = self.live.get(key)
        if block is not None and stream != block.stream:
            if block.uses is None:
                block.uses = set()
            block.uses.add(stream)

    def stream_sync(self, stream: int) -> None:
        """The events recorded on `stream` so far complete (found by the next `process_events`)."""
        self.synced[stream] = len(self.pending.get(stream, ()))

    def _process_events(self) -> None:
        """`process_events`: blocks whose events completed go back to their pool."""
        for stream, done in self.synced.items():
            queue = self.pending.get(stream, [])
            for block in queue[:done]:
                block.events -= 1
                if block.events == 0:
                    self._free_block(block)
            del queue[:done]
        self.synced.clear()

    def _free_block(self, block: _Block) -> None:
        """`free_block`: merge with free neighbours (`try_merge_blocks`), back into the pool."""
        if self.history is not None:  # free_block: TraceEntry::FREE_COMPLETED
            self.history.append(TraceEntry("free_completed", block.ptr, block.requested, block.stream, block.key))
        block.requested, block.key = 0, None
        net = 0
        for neighbour in (block.prev, block.next):
            net -= self._merge(block, neighbour)
        self._insert(block)
        if block.is_split():
            net += block.size
        if block.segment is None and net:
            self._split_bytes(net)

    def _merge(self, dst: _Block, src: _Block | None) -> int:
        """`try_merge_blocks`: the bytes `dst` took over from a free neighbour, 0 if none."""
        if src is None or src.allocated or src.events or src.uses or dst.mapped != src.mapped:
            return 0
        if src.mapped:
            self._remove(src)
        else:
            self._remove_unmapped(src)
        if dst.prev is src:
            dst.ptr, dst.prev = src.ptr, src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # -- giving memory back --
    def _release_block(self, block: _Block) -> None:
        """`release_block`: cudaFree of a whole, free segment."""
        self._remove(block)
        self.reserved -= block.size
        self.cuda_segments -= 1
        if self.history is not None:  # release_block: TraceEntry::SEGMENT_FREE
            self.history.append(TraceEntry("segment_free", block.ptr, block.size, block.stream, None))

    def _release_available_cached_blocks(self, size: int, stream: int, small: bool) -> bool:
        """`release_available_cached_blocks`: with max_split_size set, free the smallest oversize
        block that covers the request, else oversize blocks from the largest down until enough."""
        if self.max_split == SIZE_MAX:
            return False
        want = max(size, self.max_split)
        keys = self.free_lists[stream, small]
        i = bisect_left(keys, want << _SHIFT)
        if i < len(keys) and self.free_blocks[keys[i]].segment is None:
            self._release_block(self.free_blocks[keys[i]])
            return True
        released = 0
        for key in reversed(keys[:i]):
            if released >= want:
                break
            block = self.free_blocks[key]
            if block.size < self.max_split:
                break
            if block.segment is None:
                released += block.size
                self._release_block(block)
        return released >= want

    def _release_cached_blocks(self) -> None:
        """`release_cached_blocks`: wait for every stream's events, then give back every free
        unsplit segment (and the free pages of expandable segments)."""
        for stream, queue in self.pending.items():  # synchronize_and_free_events
            for block in queue:
                block.events -= 1
                if block.events == 0:
                    self._free_block(block)
            queue.clear()
        self.synced.clear()
        for small in (False, True):  # release_blocks(large_blocks), then small_blocks
            unmap = []
            for pool_key in sorted(k for k in self.free_lists if k[1] is small):
                for key in list(self.free_lists[pool_key]):
                    block = self.free_blocks[key]
                    if block.segment is not None:
                        unmap.append(block)
                    elif block.prev is None and block.next is None:
                        self._release_block(block)
            for block in unmap:
                self._unmap_block(block)
                if block.prev is None and block.next is None and not block.mapped:
                    self._remove_unmapped(block)  # release_expandable_segment
                    self.expandable_segments -= 1

    def _garbage_collect(self) -> None:
        """`garbage_collect_cached_blocks`: above threshold x allowed memory, free unsplit large
        blocks that have waited longer than average (in get_free_block calls) until under it."""
        threshold = int(self.settings.garbage_collection_threshold * self.allowed_max)
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0
        large = [self.free_blocks[k] for pool in sorted(p for p in self.free_lists if not p[1])
                 for k in self.free_lists[pool]]
        ages = [self.gc_calls[False] - b.gc_base for b in large if not b.is_split()]
        total_age, count = sum(ages), len(ages)
        freed = True
        while reclaimed < target and freed and count > 0:
            average, freed = total_age / count, False
            for block in list(large):
                age = self.gc_calls[False] - block.gc_base
                if not block.is_split() and block.segment is None and age >= average:
                    freed, reclaimed = True, reclaimed + block.size
                    total_age, count = total_age - age, count - 1
                    self._release_block(block)
                    large.remove(block)

    # -- expandable segments --
    def _page(self, small: bool) -> int:
        """`find_expandable_block`: 2 MiB pages for the small pool, large_segment_size (20 MiB) for the large."""
        return K_SMALL_BUFFER if small else self.settings.large_segment_size_bytes

    def _allocate_expandable(self, size: int, stream: int, small: bool) -> _Block | None:
        """`try_allocate_expandable_block`: map pages at the lowest address with room for `size`."""
        candidate = self._find_expandable_block(stream, small, size)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            following = candidate.next
            if not self._map_block(following, min(size - candidate.size, following.size)):
                return None
            candidate = following
        self._remove(candidate)
        return candidate

    def _find_expandable_block(self, stream: int, small: bool, size: int) -> _Block:
        """`find_expandable_block`: the lowest unmapped range (with a free block just before it)
        that has room, else a new segment for this stream and pool."""
        def allocatable(b):
            return b is not None and not b.allocated and b.events == 0 and not b.uses

        for ptr in self.unmapped[stream, small]:
            start = self.unmapped_blocks[ptr]
            if allocatable(start.prev):
                start = start.prev
            room, b = 0, start
            while room < size and allocatable(b):
                room, b = room + b.size, b.next
            if room >= size:
                return start
        page = self._page(small)
        length = -(-self.address_space // page) * page
        segment = _Segment(self.next_address, page, length)
        self.next_address += length
        self.expandable_segments += 1
        candidate = self._new_block(length, stream, small, segment.base, segment)
        candidate.mapped = False
        self._insert_unmapped(candidate)
        return candidate

    def _map_block(self, block: _Block, size: int) -> bool:
        """`map_block`: back the first `size` bytes (whole pages) with memory; merge with free neighbours."""
        segment = block.segment
        offset = block.ptr - segment.base
        end = -(-(offset + size) // segment.page) * segment.page
        mapped = end - offset
        if self.capacity is not None and self.reserved + mapped > self.capacity:
            return False  # cuMemCreate: out of memory (ExpandableSegment::map maps all or nothing)
        self._remove_unmapped(block)
        block.mapped = True
        if mapped < block.size:
            rest = self._new_block(block.size - mapped, block.stream, block.small, block.ptr + mapped, segment)
            rest.mapped = False
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            self._insert_unmapped(rest)
            block.size = mapped
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._insert(block)
        self._reserve(mapped)
        if self.history is not None:  # map_block: TraceEntry::SEGMENT_MAP of the pages just mapped
            self.history.append(TraceEntry("segment_map", segment.base + offset, mapped, block.stream, self._key))
        return True

    def _unmap_block(self, block: _Block) -> None:
        """`unmap_block`: give back the pages lying wholly inside a free block."""
        segment = block.segment
        offset = block.ptr - segment.base
        begin = -(-offset // segment.page) * segment.page
        end = (offset + block.size) // segment.page * segment.page
        if begin >= end:
            return
        self._remove(block)
        before, after = begin - offset, offset + block.size - end
        if before > 0:
            head = self._new_block(before, block.stream, block.small, block.ptr, segment)
            head.prev, head.next = block.prev, block
            if block.prev is not None:
                block.prev.next = head
            block.prev = head
            self._insert(head)
        if after > 0:
            tail = self._new_block(after, block.stream, block.small, segment.base + end, segment)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            self._insert(tail)
        block.ptr, block.size, block.mapped = segment.base + begin, end - begin, False
        self.reserved -= end - begin
        if self.history is not None:  # unmap_block: TraceEntry::SEGMENT_UNMAP
            self.history.append(TraceEntry("segment_unmap", block.ptr, block.size, block.stream, None))
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._insert_unmapped(block)

    # -- the whole stream --
    def segments(self) -> int:
        return self.cuda_segments + self.expandable_segments

    def segment_states(self) -> tuple[SegmentState, ...]:
        """The segments and their blocks now, in address order (`DeviceCachingAllocator::snapshot`: every block
        from each segment's head; an expandable segment as one segment per contiguous mapped range)."""
        blocks = {id(b): b for b in (*self.live.values(), *self.free_blocks.values(), *self.unmapped_blocks.values(),
                                     *(b for queue in self.pending.values() for b in queue))}
        pending = {id(b) for b in blocks.values() if not b.allocated and (b.events or b.uses)}
        states = []
        for head in sorted((b for b in blocks.values() if b.prev is None), key=lambda b: b.ptr):
            run: list[BlockState] = []
            block = head
            while block is not None:
                if block.mapped:
                    state = ("active_allocated" if block.allocated
                             else "active_pending_free" if id(block) in pending else "inactive")
                    live = state != "inactive"
                    run.append(BlockState(block.ptr, block.size, block.requested if live else 0, state,
                                          block.key if live else None))
                if run and (not block.mapped or block.next is None):
                    states.append(SegmentState(run[0].address, sum(b.size_bytes for b in run), head.stream, head.small,
                                               head.segment is not None, tuple(run)))
                    run = []
                block = block.next
        return tuple(states)


def _expandable_size(block: _Block) -> int:
    following = block.next
    return block.size + (following.size if following is not None and not following.mapped else 0)


def replay(events: Iterable[Event], settings: AllocatorSettings = DEFAULT_SETTINGS, *,
           capacity_bytes: int | None = None, device_total_bytes: int | None = None,
           record_history: bool = False) -> AllocatorReplay:
    """Replay `events` on a fresh allocator; an allocation that runs out of memory ends the run
    (torch raises there), and the figures are those reached until then. `record_history`: keep the
    allocator's trace entries and the segments at the end in the result."""
    history: list[TraceEntry] | None = [] if record_history else None
    model = CachingAllocatorModel(settings, capacity_bytes=capacity_bytes, device_total_bytes=device_total_bytes,
                                  history=history)
    allocated_after, reserved_after = array("q"), array("q")
    malloc, free = model.malloc, model.free
    first_oom = None
    for index, event in enumerate(events):
        kind = type(event)
        if kind is Alloc:
            if event.size_bytes > 0 and not malloc(event.key, event.size_bytes, event.stream):
                first_oom = index
                allocated_after.append(model.allocated)
                reserved_after.append(model.reserved)
                break
        elif kind is Free:
            free(event.key)
        elif kind is RecordStream:
            model.record_stream(event.key, event.stream)
        elif kind is StreamSync:
            model.stream_sync(event.stream)
        else:
            raise TypeError(f"not an allocator event: {event!r}")
        allocated_after.append(model.allocated)
        reserved_after.append(model.reserved)
    return AllocatorReplay(
        peak_allocated_bytes=model.peak_allocated, peak_reserved_bytes=model.peak_reserved,
        allocated_end_bytes=model.allocated, reserved_end_bytes=model.reserved, segments=model.segments(),
        peak_inactive_split_bytes=model.peak_inactive_split, num_alloc_retries=model.retries,
        num_ooms=model.ooms, num_oom_rejections=model.rejections, first_oom_event=first_oom,
        allocated_after=tuple(allocated_after), reserved_after=tuple(reserved_after),
        history=tuple(history or ()), segments_at_end=model.segment_states() if record_history else ())

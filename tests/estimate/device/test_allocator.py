"""The caching allocator model (zeroplan/estimate/device/allocator.py) against hand-worked streams.

Each expected figure is worked out in the comment above it from the rules of torch 2.13's
c10/cuda/CUDACachingAllocator.cpp (function named), not from running the model; the last tests
hold it against figures people measured on a GPU and published."""

from __future__ import annotations

import pytest

from zeroplan.errors import SpecError
from zeroplan.estimate.device.alloc_conf import parse_alloc_conf
from zeroplan.estimate.device.allocator import allocation_size, replay, round_size
from zeroplan.estimate.device.events import Alloc, Free, RecordStream, StreamSync

MIB = 2**20


def test_rounding_and_segment_sizes():
    # round_size: at least 512 bytes, else up to a multiple of 512
    assert [round_size(n) for n in (1, 512, 513, 3 * MIB + 1)] == [512, 512, 1024, 3 * MIB + 512]
    # get_allocation_size: <= 1 MiB -> 2 MiB; below 10 MiB -> 20 MiB; else up to 2 MiB
    assert [allocation_size(n) for n in (MIB, MIB + 512, 10 * MIB - 512, 10 * MIB, 11 * MIB)] == \
        [2 * MIB, 20 * MIB, 20 * MIB, 10 * MIB, 12 * MIB]


def test_power2_divisions_round_as_pytorch_tests_them():
    # test/test_cuda.py test_allocator_settings (run on PyTorch's GPU CI): 21 Mi floats (84 MiB) with
    # roundup_power2_divisions:4 take power2_div(84 MiB, 4): 64 MiB + 16 MiB steps -> 96 MiB
    four = parse_alloc_conf("roundup_power2_divisions:4")
    assert round_size(4 * 21 * MIB, four) == 96 * MIB
    # roundup_power2_next_division's own example: 1200 bytes in 4 divisions of [1024, 2048) -> 1280,
    # but round_size only applies it above 512 x divisions (2048 bytes), so 1200 stays 1536
    assert round_size(1200, four) == 1536 and round_size(2100, four) == 2560
    assert round_size(64 * MIB, four) == 64 * MIB  # a power of two is kept


def test_small_pool_packs_2mib_segments():
    # 1 byte -> a 512-byte block carved from a new 2 MiB small segment (kSmallBuffer)
    result = replay([Alloc("a", 1)])
    assert (result.allocated_end_bytes, result.reserved_end_bytes, result.segments) == (512, 2 * MIB, 1)
    # 4096 blocks of 512 bytes fill one 2 MiB segment exactly (the last takes the remainder whole:
    # should_split needs >= 512 left); the 4097th opens a second segment
    events = [Alloc(i, 512) for i in range(4097)]
    result = replay(events)
    assert result.reserved_after[4095] == 2 * MIB and result.reserved_after[4096] == 4 * MIB


def test_requests_below_10mib_share_a_20mib_segment():
    # two 3 MiB requests: the first cudaMallocs 20 MiB and splits (17 MiB left > 1 MiB), the second
    # takes 3 MiB of the 17 (best fit), leaving 14 MiB: reserved 20 MiB, allocated 6 MiB
    result = replay([Alloc("a", 3 * MIB), Alloc("b", 3 * MIB)])
    assert (result.reserved_end_bytes, result.allocated_end_bytes) == (20 * MIB, 6 * MIB)
    # inactive_split_bytes peaks at the 17 MiB remainder after the first split
    assert result.peak_inactive_split_bytes == 17 * MIB


def test_a_large_block_is_split_only_above_1mib_left():
    # 19.5 MiB (rounds to itself) in a fresh 20 MiB segment leaves 0.5 MiB <= kSmallSize: no split,
    # so the whole 20 MiB block is handed out and counted allocated
    result = replay([Alloc("a", 19 * MIB + MIB // 2)])
    assert (result.allocated_end_bytes, result.reserved_end_bytes) == (20 * MIB, 20 * MIB)


def test_best_fit_takes_the_smallest_block_that_holds_the_request():
    # 30 MiB and 24 MiB segments, both freed; 22 MiB takes the 24 MiB block (no new cudaMalloc),
    # and 2 MiB left is > 1 MiB so it splits: allocated 22 MiB, reserved still 54 MiB
    events = [Alloc("a", 30 * MIB), Alloc("b", 24 * MIB), Free("a"), Free("b"), Alloc("c", 22 * MIB)]
    result = replay(events)
    assert (result.allocated_end_bytes, result.reserved_end_bytes, result.segments) == (22 * MIB, 54 * MIB, 2)


def test_streams_have_their_own_pools():
    # a 3 MiB block freed on stream 0 cannot serve stream 1: a second 20 MiB segment
    result = replay([Alloc("a", 3 * MIB, 0), Free("a"), Alloc("b", 3 * MIB, 1)])
    assert result.reserved_end_bytes == 40 * MIB


def test_record_stream_delays_the_free_until_that_streams_event():
    # the 30 MiB block was used on stream 1: its free waits for an event there (insert_events), so a
    # new 30 MiB request on stream 0 cannot reuse it and cudaMallocs again: 60 MiB
    used = [Alloc("a", 30 * MIB), RecordStream("a", 1), Free("a")]
    assert replay(used + [Alloc("b", 30 * MIB)]).reserved_end_bytes == 60 * MIB
    # once stream 1 has finished (its event completes), process_events frees it: reused, 30 MiB
    assert replay(used + [StreamSync(1), Alloc("b", 30 * MIB)]).reserved_end_bytes == 30 * MIB
    # a use on the allocating stream itself is ignored (recordStream)
    assert replay([Alloc("a", 30 * MIB), RecordStream("a", 0), Free("a"), Alloc("b", 30 * MIB)]).reserved_end_bytes == 30 * MIB


def test_freed_neighbours_merge_and_the_cache_is_freed_on_a_failed_cudamalloc():
    # 3 + 3 MiB in one 20 MiB segment, both freed: the three pieces merge back into one unsplit
    # 20 MiB block. 25 MiB then needs 26 MiB (kRoundLarge); 20 + 26 > 30 MiB of device memory, so
    # cudaMalloc fails, release_cached_blocks frees the unsplit 20 MiB and the retry fits
    events = [Alloc("a", 3 * MIB), Alloc("b", 3 * MIB), Free("a"), Free("b"), Alloc("c", 25 * MIB)]
    result = replay(events, capacity_bytes=30 * MIB)
    assert (result.num_alloc_retries, result.num_ooms, result.reserved_end_bytes) == (1, 0, 26 * MIB)
    assert result.peak_reserved_bytes == 26 * MIB  # 20 was given back before 26 was taken
    # if b is still live the segment stays split, cannot be freed, and the retry fails too
    result = replay(events[:3] + [Alloc("c", 25 * MIB)], capacity_bytes=30 * MIB)
    assert (result.num_alloc_retries, result.num_ooms, result.first_oom_event) == (1, 1, 3)
    assert not result.fits


def test_max_split_size_keeps_oversize_blocks_whole():
    # max_split_size_mb:40: a cached 100 MiB block is oversize; a 30 MiB request (below 40) may not
    # take it (get_free_block), so it cudaMallocs 30 MiB: 130 MiB. Without the option it reuses it.
    events = [Alloc("a", 100 * MIB), Free("a"), Alloc("b", 30 * MIB)]
    assert replay(events).reserved_end_bytes == 100 * MIB
    limit = parse_alloc_conf("max_split_size_mb:40")
    assert replay(events, limit).reserved_end_bytes == 130 * MIB
    # an oversize request takes an oversize block only within max_non_split_rounding (20 MiB): 100 >= 60 + 20
    # is refused (new 60 MiB segment); 100 < 85 + 20 is taken whole (never split): allocated 100 MiB
    assert replay(events[:2] + [Alloc("b", 60 * MIB)], limit).reserved_end_bytes == 160 * MIB
    taken = replay(events[:2] + [Alloc("b", 85 * MIB)], limit)
    assert (taken.reserved_end_bytes, taken.allocated_end_bytes) == (100 * MIB, 100 * MIB)


def test_release_available_cached_blocks_frees_one_oversize_block_first():
    # with max_split_size_mb:40 and 150 MiB of device memory: 60 MiB cannot use the cached 100 MiB
    # block (rounding limit) and 100 + 60 > 150, so release_available_cached_blocks frees the
    # smallest oversize block >= 60 (the 100 MiB one) and alloc_block is called again: not a retry
    events = [Alloc("a", 100 * MIB), Free("a"), Alloc("b", 60 * MIB)]
    result = replay(events, parse_alloc_conf("max_split_size_mb:40"), capacity_bytes=150 * MIB)
    assert (result.num_alloc_retries, result.reserved_end_bytes, result.peak_reserved_bytes) == (0, 60 * MIB, 100 * MIB)


def test_garbage_collection_frees_old_blocks_before_cudamalloc():
    # per_process_memory_fraction 0.5 of 200 MiB allows 100 MiB; GC threshold 0.5 -> 50 MiB.
    # a (40) freed, b (60) freed: reserved 100. c (70) fits no block; GC: 100 > 50, target 50.
    # get_free_block calls on the large pool: 1 (a), 2 (b), 3 (c); a was cached at 1, b at 2: ages
    # 2 and 1, mean 1.5 -> a goes (40 reclaimed); mean 1 -> b goes (100). Then 70 <= 100: no retry.
    events = [Alloc("a", 40 * MIB), Free("a"), Alloc("b", 60 * MIB), Free("b"), Alloc("c", 70 * MIB)]
    gc = parse_alloc_conf("garbage_collection_threshold:0.5,per_process_memory_fraction:0.5")
    result = replay(events, gc, capacity_bytes=200 * MIB, device_total_bytes=200 * MIB)
    assert (result.num_alloc_retries, result.reserved_end_bytes, result.peak_reserved_bytes) == (0, 70 * MIB, 100 * MIB)
    # without the threshold the 100 MiB cap makes the first cudaMalloc fail: a full cache flush and a retry
    capped = parse_alloc_conf("per_process_memory_fraction:0.5")
    result = replay(events, capped, capacity_bytes=200 * MIB, device_total_bytes=200 * MIB)
    assert (result.num_alloc_retries, result.reserved_end_bytes) == (1, 70 * MIB)
    # and GC does nothing at fraction 1 (garbage_collect_cached_blocks needs allowed_memory_maximum)
    idle = parse_alloc_conf("garbage_collection_threshold:0.5")
    assert replay(events, idle, capacity_bytes=200 * MIB).reserved_end_bytes == 170 * MIB


def test_expandable_segments_grow_in_pages():
    es = parse_alloc_conf("expandable_segments:True")
    # 30 MiB maps two 20 MiB pages (large pool: large_segment_size pages): 40 MiB; 5 MiB fits in the
    # 10 MiB left; 700 bytes opens the small pool's segment, 2 MiB pages: 42 MiB in 2 segments.
    # The same stream without expandable segments: 30 + 20 (5 MiB < 10 MiB) + 2 = 52 MiB in 3.
    events = [Alloc("a", 30 * MIB), Alloc("b", 5 * MIB), Alloc("c", 700)]
    grown = replay(events, es, device_total_bytes=80 * 2**30)
    assert (grown.reserved_end_bytes, grown.segments) == (42 * MIB, 2)
    assert (replay(events).reserved_end_bytes, replay(events).segments) == (52 * MIB, 3)
    # 15 MiB more: the 5 MiB free at the end plus one more page mapped after it (find_expandable_block
    # starts at the free block before the unmapped range; map_block merges them): 60 + 2 = 62 MiB
    assert replay(events + [Alloc("d", 15 * MIB)], es, device_total_bytes=80 * 2**30).reserved_end_bytes == 62 * MIB


def test_expandable_segments_unmap_free_pages_when_memory_runs_out():
    # stream 0 maps 40 MiB for 30 MiB and frees it. Stream 1 needs 25 MiB: a new segment, 40 MiB of
    # pages; 40 + 40 > 50 MiB, mapping fails; release_cached_blocks unmaps stream 0's two free pages
    # (its segment, now wholly unmapped, is released) and the retry maps stream 1's: 40 MiB, 1 segment
    es = parse_alloc_conf("expandable_segments:True")
    events = [Alloc("a", 30 * MIB, 0), Free("a"), Alloc("b", 25 * MIB, 1)]
    result = replay(events, es, capacity_bytes=50 * MIB, device_total_bytes=50 * MIB)
    assert (result.num_alloc_retries, result.num_ooms, result.reserved_end_bytes, result.segments) == (1, 0, 40 * MIB, 1)


def test_per_event_figures_and_zero_size():
    # torch allocates nothing for 0 bytes; a free of it is a no-op
    result = replay([Alloc("z", 0), Alloc("a", 3 * MIB), Free("z"), Free("a")])
    assert result.allocated_after == (0, 3 * MIB, 3 * MIB, 0)
    assert result.reserved_after == (0, 20 * MIB, 20 * MIB, 20 * MIB)


def test_cuda_malloc_async_is_refused():
    with pytest.raises(SpecError, match="cudaMallocAsync.*not modelled"):
        replay([], parse_alloc_conf("backend:cudaMallocAsync"))


def test_a_published_measurement_before_the_first_forward():
    # discuss.pytorch.org/t/why-the-reserved-memory-space-generated-by-the-forwarding-of-net-cant-be-released/138814:
    # Conv2d(3, 28, 3) moved to the GPU, then torch.randn(512, 3, 224, 224).to('cuda'); the poster
    # prints "before forward 1st | memory_reserved: 296MB | memory allocated: 294MB" (MiB: 294 MiB is
    # exactly the input's 308,281,344 bytes). The weight (3,024 B) and bias (112 B) go to the small
    # pool's 2 MiB segment; the input to a 294 MiB segment (a multiple of 2 MiB).
    events = [Alloc("weight", 28 * 3 * 3 * 3 * 4), Alloc("bias", 28 * 4), Alloc("input", 512 * 3 * 224 * 224 * 4)]
    result = replay(events)
    assert result.reserved_end_bytes == 296 * MIB
    assert result.allocated_end_bytes // MIB == 294

"""PYTORCH_CUDA_ALLOC_CONF read as torch 2.13 reads it (zeroplan/estimate/device/alloc_conf.py).

Two kinds of check: the values torch's own C++ test expects (c10/test/core/AllocatorConfig_test.cpp,
quoted below), and, where torch is installed, the very strings fed to torch 2.13's parser and to
ours: both must accept or both refuse."""

from __future__ import annotations

import random

import pytest

from zeroplan.errors import SpecError
from zeroplan.estimate.device.alloc_conf import (
    CUDA_KEYS, DEFAULT_SETTINGS, SIZE_MAX, parse_alloc_conf, parse_generic, settings_from_environment, stod, stoull,
    tokenize,
)

MIB = 2**20


def test_defaults_are_torchs():
    # AllocatorConfig.h members: 20 MiB large segments, no split limit, rounding = large segment, no GC
    assert DEFAULT_SETTINGS.large_segment_size_bytes == 20 * MIB
    assert DEFAULT_SETTINGS.max_split_size_bytes == SIZE_MAX
    assert DEFAULT_SETTINGS.max_non_split_rounding_bytes == 20 * MIB
    assert DEFAULT_SETTINGS.roundup_power2_divisions == (0,) * 16
    assert (DEFAULT_SETTINGS.expandable_segments, DEFAULT_SETTINGS.backend) == (False, "native")


def test_torchs_own_expectations():
    # AllocatorConfig_test.cpp, allocator_config_test: the first env string and its EXPECT_EQs
    settings = parse_alloc_conf("max_split_size_mb:40,max_non_split_rounding_mb:30,garbage_collection_threshold:0.5,"
                                "roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1],expandable_segments:True,"
                                "pinned_use_background_threads:True")
    assert settings.max_split_size_bytes == 40 * MIB
    assert settings.max_non_split_rounding_bytes == 30 * MIB
    assert settings.garbage_collection_threshold == 0.5
    expected = {32: 8, 64: 8, 128: 2, 256: 4, 512: 2, 1024: 4, 2048: 1, 4096: 1, 8192: 1}
    assert {mb: settings.divisions_for(mb * MIB) for mb in expected} == expected
    assert settings.expandable_segments and settings.pinned_use_background_threads
    # the second string: large_segment_size_mb 15 lowers the floor of max_split_size_mb
    settings = parse_alloc_conf("large_segment_size_mb:15,max_split_size_mb:20,max_non_split_rounding_mb:40,"
                                "garbage_collection_threshold:0.8")
    assert (settings.large_segment_size_bytes, settings.max_split_size_bytes) == (15 * MIB, 20 * MIB)
    assert settings.max_non_split_rounding_bytes == 40 * MIB
    # the array syntax: the first boundary fills below it, '>' fills above the last one, 1024 stays 0
    settings = parse_alloc_conf("roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]")
    expected = {64: 8, 128: 8, 256: 16, 512: 1, 1024: 0, 2048: 8, 4096: 2}
    assert {mb: settings.divisions_for(mb * MIB) for mb in expected} == expected
    assert {parse_alloc_conf("roundup_power2_divisions:4").divisions_for(mb * MIB) for mb in (64, 256, 2048)} == {4}
    assert not parse_alloc_conf("expandable_segments:False,").expandable_segments
    with pytest.raises(SpecError, match="max_split_size_mb.*>= 25"):  # must be >= large_segment_size_mb
        parse_alloc_conf("max_split_size_mb:20,large_segment_size_mb:25")
    with pytest.raises(SpecError, match="unrecognized key 'foo'"):
        parse_alloc_conf("foo:123,bar:456")


@pytest.mark.parametrize("text, message", [
    ("expandable_segments:true", r"PYTORCH_CUDA_ALLOC_CONF: expandable_segments: write True or False, got 'true' "
                                 r"\(torch 2.13 refuses it: \"Expected 'True' or 'False' at index 2"),
    ("max_split_size_mb:10", "max_split_size_mb: must be at least 20.*too small, must be >= 20"),
    ("garbage_collection_threshold:1.5", r"garbage_collection_threshold.*set it in \(0.0, 1.0\)"),
    ("roundup_power2_divisions:3", "roundup_power2_divisions: the divisions must be a power of 2"),
    ("roundup_power2_divisions:[300:2]", "intervals have to be power of 2"),
    ("roundup_power2_divisions:[256:1,512:2", "the text ends.*write comma-separated key:value pairs"),
    ("roundup_power2_divisions:[", "a '\\[' list has no closing '\\]'.*Expected closing bracket"),
    ("max_split_size_mb", "max_split_size_mb: the text ends where a ':' or a value should follow"),
    ("backend:magic", "backend: 'magic' is not native or cudaMallocAsync"),
    ("pinned_num_register_threads:3", "pinned_num_register_threads: must be a power of 2"),
    ("pinned_num_register_threads:256", "at most 128"),
    ("per_process_memory_fraction:1.5", r"set it in \[0.0, 1.0\]"),
    ("expandable_segment:True", "unrecognized key 'expandable_segment'"),
    ("max_split_size_mb:abc", "'abc' is not a whole number"),
])
def test_refusals_are_one_line_and_name_the_key(text, message):
    with pytest.raises(SpecError, match=message) as caught:
        parse_alloc_conf(text)
    assert "\n" not in str(caught.value)


def test_the_cuda_keys():
    settings = parse_alloc_conf("backend:native,release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:True,"
                                "pinned_num_register_threads:8,per_process_memory_fraction:0.5,throw_on_cudamalloc_oom:True,"
                                "graph_capture_record_stream_reuse:True,pinned_reserve_segment_size_mb:64,"
                                "pinned_free_catch_all:True")
    assert settings.release_lock_on_cudamalloc and settings.pinned_use_cuda_host_register
    assert (settings.pinned_num_register_threads, settings.per_process_memory_fraction) == (8, 0.5)
    assert settings.throw_on_cudamalloc_oom and settings.graph_capture_record_stream_reuse
    assert (settings.pinned_reserve_segment_size_mb, settings.pinned_free_catch_all) == (64, True)
    async_ = parse_alloc_conf("backend:cudaMallocAsync,max_split_size_mb:100")
    assert async_.backend == "cudaMallocAsync" and "ignores max_split_size_mb" in async_.warnings[0]


def test_torchs_number_reading():
    # std::stoull reads a leading decimal number; a minus wraps around; std::stod takes hex and inf
    assert [stoull(t) for t in ("100x", "+40", "-5", "0x20")] == [100, 40, 2**64 - 5, 0]
    assert [stod(t) for t in ("0.5e", ".5", "0x0.8p0", "5e-1")] == [0.5, 0.5, 0.5, 0.5]
    assert tokenize(" max split_size_mb : [1, 2]") == ["maxsplit_size_mb", ":", "[", "1", ",", "2", "]"]


def test_which_variable():
    # CUDAAllocatorConfig.h instance(): PYTORCH_CUDA_ALLOC_CONF first, PYTORCH_ALLOC_CONF when it is unset
    both = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:100", "PYTORCH_ALLOC_CONF": "max_split_size_mb:200"}
    assert settings_from_environment(both).max_split_size_bytes == 100 * MIB
    assert settings_from_environment({"PYTORCH_ALLOC_CONF": "max_split_size_mb:200"}).variable == "PYTORCH_ALLOC_CONF"
    assert settings_from_environment({}) == DEFAULT_SETTINGS
    with pytest.raises(SpecError, match="^PYTORCH_ALLOC_CONF: "):
        settings_from_environment({"PYTORCH_ALLOC_CONF": "expandable_segments:yes"})


# -- against torch's own parser -------------------------------------------------------------------

CASES = [
    "", "max_split_size_mb:100", "max_split_size_mb=100", "max_split_size_mb", "max_split_size_mb:", "max_split_size_mb:-5",
    "max_split_size_mb:19", "max_split_size_mb:100x", "max_split_size_mb,100", "max_split_size_mb:100,",
    "max_split_size_mb:100,,", ",max_split_size_mb:100", "max_split_size_mb:100 garbage_collection_threshold:0.5",
    " max_split _size_mb : 100 ", "max_split_size_mb:100:200", "large_segment_size_mb:10", "large_segment_size_mb:11",
    "large_segment_size_mb:40,max_split_size_mb:30", "max_non_split_rounding_mb:19", "garbage_collection_threshold:0",
    "garbage_collection_threshold:0.999", "garbage_collection_threshold:nan", "garbage_collection_threshold:1e-310",
    "garbage_collection_threshold:0x0.8p0", "garbage_collection_threshold:.", "roundup_power2_divisions:4",
    "roundup_power2_divisions:0", "roundup_power2_divisions:[256:1,512:2,>:8]", "roundup_power2_divisions:[256:3]",
    "roundup_power2_divisions:[>:8]", "roundup_power2_divisions:[]", "roundup_power2_divisions:[256:1 512:2]",
    "roundup_power2_divisions:[256]", "roundup_power2_divisions:[256:2]]", "roundup_power2_divisions:[256:2,",
    "expandable_segments:True", "expandable_segments:true", "expandable_segments:[True]", "pinned_use_background_threads:yes",
    "pinned_max_round_threshold_mb:128,pinned_max_cached_size_mb:64", "pinned_max_round_threshold_mb:99999999999999999999",
    "foo:[1,2,3],max_split_size_mb:100", "foo:[1,2", "a:b:c", ",", "[a:b]", "foo:large_segment_size_mb",
]
ATOMS = ["max_split_size_mb", "large_segment_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
         "roundup_power2_divisions", "expandable_segments", "pinned_use_background_threads", "pinned_max_cached_size_mb",
         "foo", ":", ",", "[", "]", ">", "True", "true", "0", "1", "3", "8", "20", "21", "40", "256", "0.5", "1.5", "-1", " "]


def _torch_accepts(set_settings, text: str) -> bool:
    set_settings("large_segment_size_mb:20")  # the one value torch keeps from call to call
    try:
        set_settings(text)
    except (RuntimeError, ValueError, IndexError):
        return False
    return True


def _we_accept(text: str) -> bool:
    try:
        parse_generic(text, registered=None)  # no device parser registered: as on a CPU-only build
    except SpecError:
        return False
    return True


def test_accepts_and_refuses_what_torch_does():
    torch = pytest.importorskip("torch")
    set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if set_settings is None:
        pytest.skip("this torch has no accelerator-generic allocator parser")
    rng = random.Random(2013)
    texts = CASES + ["".join(rng.choice(ATOMS) for _ in range(rng.randint(1, 9))) for _ in range(3000)]
    differ = [text for text in texts if _torch_accepts(set_settings, text) != _we_accept(text)]
    assert not differ, differ[:10]
    set_settings("")


def test_a_cuda_build_refuses_what_a_cpu_build_skips():
    # on a CUDA build the CUDA parser has registered its keys: an unknown key is refused, a CUDA key passes
    assert parse_generic("foo:1", registered=None) is not None
    with pytest.raises(SpecError, match="unrecognized key 'foo'"):
        parse_generic("foo:1", registered=CUDA_KEYS)
    parse_generic("backend:native", registered=CUDA_KEYS)

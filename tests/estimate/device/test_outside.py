"""Memory outside the allocator (estimate/device/outside.py) and the three figures (figures.py).

The constants are checked against the sources they are read from (NCCL's src/init.cc and
src/include/device.h, PyTorch's CublasHandlePool.cpp), the context sizes against the published
measurements they quote; the figures against their definitions (device = reserved + outside)."""

from __future__ import annotations

import pytest

from zeroplan.errors import SpecError
from zeroplan.estimate.device.alloc_conf import parse_alloc_conf
from zeroplan.estimate.device.events import Alloc, Free
from zeroplan.estimate.device.figures import gpu_figures, tensor_peak
from zeroplan.estimate.device.outside import (
    LL128_BUFFSIZE, LL_BUFFSIZE, SIMPLE_BUFFSIZE, ProcessGroup, cublas_workspace_bytes, cuda_context, nccl_terms,
    outside_terms,
)
from zeroplan.importers.gpus import get_gpu

MIB = 2**20


def test_nccl_buffer_sizes_are_ncclss_defaults():
    # init.cc: DEFAULT_LL_BUFFSIZE = 8 lines/thread x 512 threads x 8 steps x 16-byte lines = 512 KiB;
    # DEFAULT_LL128_BUFFSIZE = 120 elements/thread x 640 threads x 8 steps x 8 bytes; DEFAULT_BUFFSIZE 4 MiB
    assert (LL_BUFFSIZE, LL128_BUFFSIZE, SIMPLE_BUFFSIZE) == (524_288, 4_915_200, 4_194_304)


def test_a_ring_holds_one_buffer_set_per_channel():
    # HGX A100: 24 ring channels (nccl-tests#100) x 9,633,792 bytes
    (ring,) = nccl_terms(ProcessGroup("dp", 8), architecture="ampere", interconnect="nvswitch",
                         compute_capability=(8, 0), environ={})
    assert ring.size_bytes == 24 * (LL_BUFFSIZE + LL128_BUFFSIZE + SIMPLE_BUFFSIZE)
    # NCCL_BUFFSIZE changes the SIMPLE part; a group of one has no communicator traffic
    (small,) = nccl_terms(ProcessGroup("dp", 8), architecture="ampere", interconnect="nvswitch",
                          compute_capability=(8, 0), environ={"NCCL_BUFFSIZE": str(MIB)})
    assert ring.size_bytes - small.size_bytes == 24 * 3 * MIB
    assert nccl_terms(ProcessGroup("tp", 1), architecture="ampere", interconnect="nvswitch",
                      compute_capability=(8, 0), environ={}) == []
    with pytest.raises(SpecError, match="NCCL_BUFFSIZE: '4M' is not a positive number of bytes"):
        nccl_terms(ProcessGroup("dp", 8), architecture="ampere", interconnect="pcie", compute_capability=(8, 6),
                   environ={"NCCL_BUFFSIZE": "4M"})


def test_nvls_on_hopper_switches_only():
    # nvls.cc: 16 channels on sm_90 x 2 x (128 KiB x 8 steps) per head, a head per local rank: 8 GPUs -> 256 MiB
    terms = nccl_terms(ProcessGroup("dp", 8), architecture="hopper", interconnect="nvswitch", compute_capability=(9, 0),
                       environ={})
    assert [t.name for t in terms] == ["nccl_ring:dp", "nccl_nvls:dp"] and terms[1].size_bytes == 256 * MIB
    off = nccl_terms(ProcessGroup("dp", 8), architecture="hopper", interconnect="nvswitch", compute_capability=(9, 0),
                     environ={"NCCL_NVLS_ENABLE": "0"})
    assert [t.name for t in off] == ["nccl_ring:dp"]
    # PCIe: 2 channels, no NVLS
    pcie = nccl_terms(ProcessGroup("dp", 8), architecture="ampere", interconnect="pcie", compute_capability=(8, 6),
                      environ={})
    assert [t.size_bytes for t in pcie] == [2 * (LL_BUFFSIZE + LL128_BUFFSIZE + SIMPLE_BUFFSIZE)]


def test_pipeline_peers_add_p2p_buffers():
    # init.cc computeBuffSizes: 512 KiB chunks over NVLink, x 8 steps, per channel and peer
    terms = nccl_terms(ProcessGroup("pp", 4, p2p_peers=2), architecture="ampere", interconnect="nvswitch",
                       compute_capability=(8, 0), environ={})
    assert terms[-1].name == "nccl_p2p:pp" and terms[-1].size_bytes == 2 * 24 * (512 * 1024) * 8


def test_context_sizes_are_the_published_ones():
    assert cuda_context((8, 6), (12, 8)).size_bytes == 256 * MIB  # InvokeAI#9413, RTX 3090
    assert cuda_context((8, 9), (13, 0)).size_bytes == 426 * MIB  # unsloth-zoo#1053, RTX 6000 Ada
    unknown = cuda_context((9, 0), (12, 8))
    assert unknown.size_bytes == 400 * MIB and "no published measurement for sm_90" in unknown.source
    # eager loading (or CUDA before 11.7): PyTorch's measurement in pull 86509, less its 20 MiB segment
    assert cuda_context((8, 0), (11, 6)).size_bytes == 666_632_192 - 20 * MIB
    assert cuda_context((8, 0), None, "eager").size_bytes == 666_632_192 - 20 * MIB
    with pytest.raises(SpecError, match="module_loading: 'lazy-ish'"):
        cuda_context((8, 0), None, "lazy-ish")


def test_cublas_workspace_follows_compute_capability_and_env():
    # CublasHandlePool.cpp parseChosenWorkspaceSize: 32 MiB on 9.x/10.x/12.x, else :4096:2:16:8
    assert cublas_workspace_bytes((9, 0), {}) == 32 * MIB
    assert cublas_workspace_bytes((8, 0), {}) == 2 * 4096 * 1024 + 8 * 16 * 1024
    assert cublas_workspace_bytes((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * MIB
    assert cublas_workspace_bytes((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * 1024
    assert cublas_workspace_bytes((9, 0), {"CUBLAS_WORKSPACE_CONFIG": "nonsense"}) == 32 * MIB  # warns, default


def test_overrides_replace_a_term_and_name_unknown_ones():
    groups = (ProcessGroup("dp_shard", 8),)
    terms = outside_terms(architecture="hopper", compute_capability=(9, 0), cuda_version=(12, 8), interconnect="nvswitch",
                          process_groups=groups, overrides={"cuda_context": 500 * MIB})
    assert terms[0].size_bytes == 500 * MIB and terms[0].overridden and "was 419,430,400 B" in terms[0].source
    with pytest.raises(SpecError, match="overrides: no term named 'nccl_ring:tp'"):
        outside_terms(architecture="hopper", compute_capability=(9, 0), cuda_version=None, interconnect="nvswitch",
                      process_groups=groups, overrides={"nccl_ring:tp": 1})
    with pytest.raises(SpecError, match="interconnect: 'ethernet'"):
        outside_terms(architecture="hopper", compute_capability=(9, 0), cuda_version=None, interconnect="ethernet",
                      process_groups=groups)


def test_three_figures_follow_their_definitions():
    events = [Alloc("params", 1000 * MIB), Alloc("act", 300 * MIB), Free("act"), Alloc("grad", 1000 * MIB)]
    figures = gpu_figures({"rank": events}, get_gpu("h100-80gb"), process_groups=[ProcessGroup("dp_shard", 8)])
    rank = figures["rank"]
    # the tensors peak at params + grad (act is freed first); two 32 MiB cuBLAS workspaces join the
    # stream: allocated = 2000 MiB + 64 MiB (all multiples of 512 bytes, no rounding)
    assert rank.tensor_peak_bytes == tensor_peak(events) == 2000 * MIB
    assert rank.allocated_bytes == 2000 * MIB + 64 * MIB
    assert rank.reserved_bytes >= rank.allocated_bytes
    assert rank.device_bytes == rank.reserved_bytes + sum(t.size_bytes for t in rank.outside)
    assert rank.capacity_bytes == get_gpu("h100-80gb").memory_bytes - sum(t.size_bytes for t in rank.outside)
    assert rank.fits


def test_out_of_memory_follows_the_replay():
    # 24 GiB RTX 3090, outside ~275 MiB: a 23.9 GiB tensor does not fit even though it is below 24 GiB
    big = [Alloc("x", int(23.9 * 2**30))]
    rank = gpu_figures({"rank": big}, get_gpu("rtx3090-24gb"), process_groups=[ProcessGroup("dp", 8)])["rank"]
    assert not rank.fits and rank.replay.num_ooms == 1
    # expandable segments: the two 8.125 MiB workspaces share the first 20 MiB page, leaving 3.75 MiB;
    # 30 MiB starts there and maps 26.25 MiB more, two pages: 60 MiB reserved (without them: 20 + 30)
    es = gpu_figures({"rank": [Alloc("x", 30 * MIB)]}, get_gpu("rtx3090-24gb"), process_groups=[],
                     settings=parse_alloc_conf("expandable_segments:True"))["rank"]
    assert es.reserved_bytes == 60 * MIB
    plain = gpu_figures({"rank": [Alloc("x", 30 * MIB)]}, get_gpu("rtx3090-24gb"), process_groups=[])["rank"]
    assert plain.reserved_bytes == 20 * MIB + 30 * MIB

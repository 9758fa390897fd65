"""GPU presets: the capacities the vendors state, read in the binary sense DRAM sizes use, and
cross-checked against what PyTorch reported on those GPUs in public issues."""

from __future__ import annotations

import re

import pytest

from zeroplan.errors import SpecError
from zeroplan.importers.gpus import all_gpus, get_gpu, gpu_names

GIB = 2**30


def test_required_presets_exist():
    assert set(gpu_names()) >= {"a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "l4-24gb", "rtx3090-24gb", "rtx4090-24gb",
                                 "mi300x-192gb"}


@pytest.mark.parametrize("name", gpu_names())
def test_memory_is_the_stated_capacity_in_gib(name):
    gpu = get_gpu(name)
    stated = int(re.match(r"(\d+)GB ", gpu.stated_memory).group(1))
    assert stated == int(re.search(r"(\d+)gb$", name).group(1))  # the name says what the datasheet says
    assert gpu.memory_bytes == stated * GIB
    assert gpu.source.startswith("https://")


def test_h100_80gb_is_80_gib():
    assert get_gpu("h100-80gb").memory_bytes == 85_899_345_920


@pytest.mark.parametrize("gpu", [gpu for gpu in all_gpus() if gpu.reported_total_gib is not None], ids=lambda g: g.name)
def test_reported_total_memory_is_just_below_the_stated_capacity(gpu):
    """PyTorch's total_memory excludes what the driver reserves: within 3% below the capacity,
    which the plan's default 5% headroom covers."""
    reported = gpu.reported_total_gib * GIB
    assert 0.97 * gpu.memory_bytes < reported < gpu.memory_bytes
    assert gpu.reported_source.startswith("https://github.com/")


def test_one_way_bandwidths_are_half_the_datasheet_totals():
    h100 = get_gpu("h100-80gb")
    assert h100.gpu_link_one_way_bytes_per_s == 450e9  # NVLink 900 GB/s total
    assert h100.pcie_one_way_bytes_per_s == 64e9  # PCIe Gen5 x16 128 GB/s total
    l4 = get_gpu("l4-24gb")  # no NVLink: GPUs talk over PCIe
    assert l4.gpu_link_one_way_bytes_per_s == l4.pcie_one_way_bytes_per_s == 32e9


def test_presets_sorted_by_memory():
    sizes = [gpu.memory_bytes for gpu in all_gpus()]
    assert sizes == sorted(sizes)


def test_unknown_gpu_suggests_close_names():
    assert get_gpu("H100-80GB").name == "h100-80gb"
    with pytest.raises(SpecError, match=r"--gpu: unknown GPU 'a100-80'; did you mean a100-80gb"):
        get_gpu("a100-80")
    with pytest.raises(SpecError, match=r"--gpu: unknown GPU 'tpu-v5'.*known: a100-40gb"):
        get_gpu("tpu-v5")


@pytest.mark.parametrize("name, architecture, capability, interconnect", [
    ("a100-80gb", "ampere", (8, 0), "nvswitch"), ("h100-80gb", "hopper", (9, 0), "nvswitch"),
    ("h200-141gb", "hopper", (9, 0), "nvswitch"), ("l4-24gb", "ada", (8, 9), "pcie"),
    ("rtx3090-24gb", "ampere", (8, 6), "pcie"), ("rtx4090-24gb", "ada", (8, 9), "pcie"),
    ("mi300x-192gb", "cdna3", None, "infinity-fabric"),
])
def test_presets_name_their_architecture(name, architecture, capability, interconnect):
    # NVIDIA's CUDA GPUs table (developer.nvidia.com/cuda-gpus): A100 8.0, H100/H200 9.0, L4 and
    # RTX 4090 8.9, RTX 3090 8.6; the MI300X is CDNA 3 (gfx942) and has no compute capability
    gpu = get_gpu(name)
    assert (gpu.architecture, gpu.compute_capability_pair, gpu.interconnect) == (architecture, capability, interconnect)


def test_rtx3090_is_a_24_gib_pcie_ampere_card():
    gpu = get_gpu("rtx3090-24gb")
    assert gpu.memory_bytes == 24 * GIB and gpu.nvlink_bandwidth_gbps == 0
    assert gpu.gpu_link_one_way_bytes_per_s == 32e9  # over PCIe Gen4 x16

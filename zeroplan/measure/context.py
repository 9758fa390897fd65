"""The CPU/GPU seam of the measure mode, and nothing else: device, backend, process group, memory probe.

Everything outside this module runs the same on `gloo` (CPU worker processes), `nccl` (one
process per CUDA GPU) and `fake` (one process simulating N ranks under FakeTensorMode).
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import TYPE_CHECKING

from zeroplan.errors import MeasureError

if TYPE_CHECKING:  # torch is imported inside the functions that run in a rank: the launcher needs none
    import torch

BACKENDS = ("gloo", "nccl", "fake")
# The NVIDIA driver lists each GPU of a Linux host here, one folder per PCI device (no CUDA call).
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


def default_backend() -> str:
    """nccl where CUDA GPUs are visible, otherwise gloo."""
    return "nccl" if visible_cuda_devices() > 0 else "gloo"


def visible_cuda_devices() -> int:
    """The CUDA devices a rank's torch will see, read without importing torch (which would cost
    the launcher more than a CPU run's whole set-up): the GPUs the NVIDIA driver lists, narrowed
    by CUDA_VISIBLE_DEVICES, none for a CPU build of torch. A rank that finds fewer (a CUDA build
    without a local tag, ROCm) fails at `device_for`, naming its rank."""
    if _torch_local_version() == "cpu":  # the CPU wheels are versioned "2.x.y+cpu"
        return 0
    try:
        physical = sum(1 for _ in NVIDIA_GPUS.iterdir())
    except OSError:  # no NVIDIA driver (not Linux, no GPU)
        return 0
    return _narrowed(physical, os.environ.get("CUDA_VISIBLE_DEVICES"))


def _torch_local_version() -> str:
    try:
        return importlib.metadata.version("torch").partition("+")[2]
    except importlib.metadata.PackageNotFoundError:
        return "cpu"  # no torch: `zeroplan measure` says so before asking for a backend


def _narrowed(physical: int, visible: str | None) -> int:
    """Devices left by CUDA_VISIBLE_DEVICES, as CUDA reads it: indices or GPU-/MIG- UUIDs, up to
    the first invalid entry ("-1" hides every device)."""
    if visible is None:
        return physical
    count = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if not entry.startswith(("GPU-", "MIG-")) and not (entry.isdigit() and int(entry) < physical):
            break
        count += 1
    return min(count, physical)


def device_for(backend: str, local_rank: int) -> torch.device:
    """cuda:<local_rank> for nccl; cpu for gloo, and for fake (fake CUDA tensors abort on a CPU build)."""
    import torch

    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise MeasureError(f"nproc: local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible)")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_process_group(backend: str, rank: int, world_size: int, init_method: str | None) -> None:
    """Join the process group: `init_method` (file:// or env://) for gloo/nccl; a FakeStore for fake."""
    import torch
    import torch.distributed as dist

    if backend == "fake":
        # Registers the "fake" backend: torch/testing/_internal/distributed/fake_pg.py
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        return
    if backend == "gloo" and (init_method or "").startswith("file://"):
        # The default TCP rendezvous listens on every interface; a file store and the loopback
        # interface keep a local run on this machine (NOTES: torch.distributed on CPU). Across
        # nodes (env://, measure/nodes.py) gloo takes the interface the launcher gives, or its own.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if backend == "nccl":
        torch.cuda.set_device(device_for(backend, int(os.environ.get("LOCAL_RANK", rank))))
    dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=world_size)


class MemoryProbe:
    """The device allocator's view of a phase. On CPU there is none: the accounting is exact."""

    def begin_phase(self) -> None:
        pass

    def end_phase(self) -> dict[str, int] | None:
        return None


class CudaProbe(MemoryProbe):
    """`torch.cuda.memory_stats()` per phase: allocated and reserved, current and peak (peaks reset
    at each phase), inactive split bytes, allocation retries and OOMs. Reserved minus allocated is
    the allocator's overhead (cached blocks, 512-byte rounding) that the tensor accounting cannot
    see. At the end of each phase NVML's used memory too: `process_used_bytes`, this process's own
    (nvmlDeviceGetComputeRunningProcesses, what nvidia-smi lists per process), and
    `device_used_bytes`, the whole GPU's (`torch.cuda.device_memory_used`); both need pynvml
    (nvidia-ml-py), and are left out without it."""

    KEYS = {
        "allocated_bytes": "allocated_bytes.all.current",
        "allocated_peak_bytes": "allocated_bytes.all.peak",
        "reserved_bytes": "reserved_bytes.all.current",
        "reserved_peak_bytes": "reserved_bytes.all.peak",
        "inactive_split_peak_bytes": "inactive_split_bytes.all.peak",
        "num_alloc_retries": "num_alloc_retries",
        "num_ooms": "num_ooms",
    }

    def __init__(self, device: torch.device):
        self.device = device

    def begin_phase(self) -> None:
        import torch

        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def end_phase(self) -> dict[str, int]:
        import torch

        torch.cuda.synchronize(self.device)
        stats = torch.cuda.memory_stats(self.device)
        return {name: int(stats.get(key, 0)) for name, key in self.KEYS.items()} | nvml_used(self.device)


def nvml_used(device: torch.device) -> dict[str, int]:
    """NVML's used memory: this process's and the whole device's; {} where pynvml is missing."""
    import torch

    try:
        import pynvml
    except ImportError:
        return {}
    used = {"device_used_bytes": int(torch.cuda.device_memory_used(device))}  # initialises NVML
    # the process's own figure: NVML finds the GPU by PCI address (NVML_DEVICE_PCI_BUS_ID_FMT), as the
    # allocator's own out-of-memory report does (CUDACachingAllocator.cpp reportProcessMemoryInfo)
    props = torch.cuda.get_device_properties(device)
    address = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if None not in address:
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(f"{address[0]:08X}:{address[1]:02X}:{address[2]:02X}.0")
        mine = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                if p.pid == os.getpid() and p.usedGpuMemory is not None]
        if mine:
            used["process_used_bytes"] = int(mine[0])
    return used


def make_probe(device: torch.device) -> MemoryProbe:
    return CudaProbe(device) if device.type == "cuda" else MemoryProbe()

"""The three figures of a rank: allocated, reserved and device bytes, each with its terms.

- allocated: `torch.cuda.max_memory_allocated()`, the allocator's peak of handed-out blocks (the
  tensors rounded to 512 bytes, plus cuBLAS's workspaces);
- reserved: `torch.cuda.max_memory_reserved()`, the peak of the segments it holds
  (allocator.py replays the rank's allocation stream);
- device: what nvidia-smi shows for the process at that peak: reserved plus the memory outside
  the allocator (outside.py: the CUDA context, NCCL's buffers per communicator).

`gpu_figures` is the function the estimator calls with its ledger's events; it takes plain data
and imports nothing beyond this package, so the estimate stays free of torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from zeroplan.estimate.device.alloc_conf import DEFAULT_SETTINGS, AllocatorSettings
from zeroplan.estimate.device.allocator import AllocatorReplay, replay
from zeroplan.estimate.device.events import Alloc, Event, Free
from zeroplan.estimate.device.outside import OutsideTerm, ProcessGroup, cublas_workspace_bytes, outside_terms

# cuBLAS keeps one workspace per (handle, stream) (CublasHandlePool.cpp `setWorkspaceForHandle`) and
# a handle per thread (its thread-local PoolWindow): forward runs on the Python thread, backward on
# the autograd engine's device thread (torch/csrc/autograd/engine.cpp, one thread per CUDA device),
# both on the default stream: two workspaces.
DEFAULT_CUBLAS_HANDLES = 2
WORKSPACE_KEY = "zeroplan:cublas_workspace"
"""The first part of the key of each cuBLAS workspace's allocation: (WORKSPACE_KEY, handle number)."""


class GpuFacts(Protocol):
    """What the figures need of a GPU; zeroplan.importers.gpus.GpuPreset has it."""

    name: str
    architecture: str
    memory_bytes: int

    @property
    def compute_capability_pair(self) -> tuple[int, int] | None: ...

    @property
    def interconnect(self) -> str: ...


@dataclass(frozen=True)
class DeviceFigures:
    """One rank kind's three figures and what they are made of."""

    rank_kind: str
    tensor_peak_bytes: int  # the stream's own peak, sizes as requested (no rounding, no workspaces)
    allocated_bytes: int  # predicted max_memory_allocated()
    reserved_bytes: int  # predicted max_memory_reserved()
    device_bytes: int  # predicted nvidia-smi figure: reserved + outside
    capacity_bytes: int  # what the allocator could get: the GPU's memory less what lives outside it
    allocator_terms: tuple[OutsideTerm, ...]  # allocations added to the stream (cuBLAS workspaces)
    outside: tuple[OutsideTerm, ...]  # memory outside the allocator
    replay: AllocatorReplay
    # the replay against the GPU's capacity ran out of memory: these figures are then the program's needs, from a
    # replay on a GPU without limit (estimate/device/estimate.py `device_figures`)
    ran_out: bool = False
    # what the device held when that allocation failed: the replay's reserved bytes then, and the memory outside the
    # allocator (torch's OutOfMemoryError: "this process has ... memory in use"); None when it did not run out
    device_at_oom_bytes: int | None = None

    @property
    def outside_bytes(self) -> int:
        return sum(term.size_bytes for term in self.outside)

    @property
    def fits(self) -> bool:
        """No allocation ran out of memory: reserved stayed within the capacity, so device within the GPU."""
        return self.replay.fits and not self.ran_out

    @property
    def reserved_at_oom_bytes(self) -> int | None:
        """Reserved bytes when this replay's first allocation failed (None if none did)."""
        index = self.replay.first_oom_event
        return None if index is None else self.replay.reserved_after[index]


def tensor_peak(events: Sequence[Event]) -> int:
    """The peak of live requested bytes along the stream (what a live-tensor count reports)."""
    live: dict = {}
    current = peak = 0
    for event in events:
        if type(event) is Alloc:
            live[event.key] = event.size_bytes
            current += event.size_bytes
            peak = max(peak, current)
        elif type(event) is Free:
            current -= live.pop(event.key, 0)
    return peak


def gpu_figures(events_by_rank_kind: Mapping[str, Sequence[Event]], gpu: GpuFacts, *,
                process_groups: Sequence[ProcessGroup], settings: AllocatorSettings = DEFAULT_SETTINGS,
                cuda_version: tuple[int, int] | None = None, environ: Mapping[str, str] | None = None,
                cublas_handles: int = DEFAULT_CUBLAS_HANDLES, module_loading: str = "lazy",
                overrides: Mapping[str, int] | None = None,
                program_outside: Mapping[str, Sequence[OutsideTerm]] | None = None,
                record_history: bool = False) -> dict[str, DeviceFigures]:
    """Allocated, reserved and device bytes of each rank kind.

    events_by_rank_kind: rank kind (e.g. "rank0", "first-stage", "last-stage") -> that rank's
      allocations and frees in program order (events.py); a key must be unique while live.
    gpu: the GPU preset (architecture, compute capability, interconnect, memory).
    process_groups: the communicators one rank is in: one per mesh dimension of size > 1, and the
      world group if the program uses it (one NCCL communicator each).
    settings: PYTORCH_CUDA_ALLOC_CONF as parsed (alloc_conf.parse_alloc_conf), with the recipe's
      default where the program sets one (torchtitan: expandable_segments:True).
    environ: NCCL_* and CUBLAS_WORKSPACE_CONFIG values, if set.
    cublas_handles: cuBLAS workspaces allocated (one per thread and stream running matmuls).
    overrides: bytes for any outside term by name (outside.outside_terms).
    program_outside: rank kind -> what its program keeps outside the allocator besides the CUDA context and
      NCCL (async TP's symmetric memory: estimate/parallel/mesh.py).
    record_history: keep each replay's trace and its segments at the end (allocator.py; snapshot.py draws them).
    """
    environ = environ or {}
    common = rank_outside_terms(gpu, process_groups, cuda_version=cuda_version, environ=environ,
                                module_loading=module_loading, overrides=overrides)
    workspace = cublas_workspace_bytes(gpu.compute_capability_pair, environ)
    workspaces = tuple(OutsideTerm(f"cublas_workspace:{i}", workspace,
                                   "aten/src/ATen/cuda/CublasHandlePool.cpp parseChosenWorkspaceSize, allocated from "
                                   "the caching allocator at the first matmul of each handle and stream")
                       for i in range(cublas_handles))
    figures = {}
    for kind, events in events_by_rank_kind.items():
        outside = common + tuple((program_outside or {}).get(kind, ()))
        outside_bytes = sum(t.size_bytes for t in outside)
        capacity = max(gpu.memory_bytes - outside_bytes, 0)
        stream = [Alloc((WORKSPACE_KEY, i), workspace) for i in range(cublas_handles)] + list(events)
        result = replay(stream, settings, capacity_bytes=capacity, device_total_bytes=gpu.memory_bytes,
                        record_history=record_history)
        figures[kind] = DeviceFigures(kind, tensor_peak(events), result.peak_allocated_bytes, result.peak_reserved_bytes,
                                      result.peak_reserved_bytes + outside_bytes, capacity, workspaces, outside, result)
    return figures


def rank_outside_terms(gpu: GpuFacts, process_groups: Sequence[ProcessGroup], *, cuda_version: tuple[int, int] | None = None,
                       environ: Mapping[str, str] | None = None, module_loading: str = "lazy",
                       overrides: Mapping[str, int] | None = None) -> tuple[OutsideTerm, ...]:
    """The terms outside the allocator on one rank of `gpu` in `process_groups` (outside.py)."""
    return outside_terms(architecture=gpu.architecture, compute_capability=gpu.compute_capability_pair,
                         cuda_version=cuda_version, interconnect=_interconnect(gpu),
                         process_groups=tuple(process_groups), environ=environ or {}, module_loading=module_loading,
                         overrides=overrides)


def _interconnect(gpu: GpuFacts) -> str:
    """AMD's Infinity Fabric has no channel counts of its own here: RCCL is NCCL's port (same buffer
    sizes), and its fully connected links are taken as a switch (docs/engines/allocator.md says so)."""
    return "nvswitch" if gpu.interconnect == "infinity-fabric" else gpu.interconnect

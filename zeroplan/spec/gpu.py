"""The GPU a run uses, as far as its memory depends on it: capacity, architecture and compute capability
(the CUDA context's size and cuBLAS's workspaces), and how a node's GPUs are linked (NCCL's channels).
zeroplan/importers/gpus.py builds it from a preset (`--gpu`, `--gpu-memory NAME`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from zeroplan.spec.limits import MAX_COUNT


class GpuSpec(BaseModel):
    """One GPU of the run (all alike)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="The preset's name, e.g. h100-80gb.")
    memory_bytes: int = Field(ge=1, le=MAX_COUNT, description="Memory of one GPU, in bytes.")
    architecture: Literal["volta", "turing", "ampere", "ada", "hopper", "blackwell", "cdna3"] = Field(
        description="GPU architecture (NVIDIA's generation, AMD's CDNA generation).")
    compute_capability: str | None = Field(None, pattern=r"^[0-9]+\.[0-9]+$",
                                           description="CUDA compute capability, e.g. '9.0'; none for AMD GPUs.")
    interconnect: Literal["nvswitch", "pcie", "infinity-fabric"] = Field(
        description="How a node's GPUs talk: NVLink switches, PCIe, AMD's Infinity Fabric.")

    @property
    def compute_capability_pair(self) -> tuple[int, int] | None:
        """(major, minor), as torch.cuda.get_device_capability() gives it; None without CUDA."""
        if self.compute_capability is None:
            return None
        major, minor = self.compute_capability.split(".")
        return int(major), int(minor)

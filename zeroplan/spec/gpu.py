"""The GPU a run uses, as far as its memory depends on it: capacity, architecture and compute capability
(the CUDA context's size and cuBLAS's workspaces), and how a node's GPUs are linked (NCCL's channels).
zeroplan/importers/gpus.py builds it from a preset (`--gpu`, `--gpu-memory NAME`)."""

# No `from __future__ import annotations` here: pydantic would compile each field's annotation string
# (typing.ForwardRef) as the models are built, 2 ms of every command's start-up (bench/estimate_speed.py).

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from zeroplan.spec.limits import MAX_COUNT


# the generations whose CUDA context and cuBLAS workspace zeroplan knows (estimate/device/outside.py)
Architecture = Literal["volta", "turing", "ampere", "ada", "hopper", "blackwell", "cdna3"]
COMPUTE_CAPABILITY_PATTERN = r"^[0-9]+\.[0-9]+$"


def capability_pair(compute_capability: str | None) -> tuple[int, int] | None:
    """'9.0' as (9, 0), as torch.cuda.get_device_capability() gives it; None without CUDA."""
    if compute_capability is None:
        return None
    major, minor = compute_capability.split(".")
    return int(major), int(minor)


class GpuSpec(BaseModel):
    """One GPU of the run (all alike)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="The preset's name, e.g. h100-80gb.")
    memory_bytes: int = Field(ge=1, le=MAX_COUNT, description="Memory of one GPU, in bytes.")
    architecture: Architecture = Field(description="GPU architecture (NVIDIA's generation, AMD's CDNA generation).")
    compute_capability: str | None = Field(None, pattern=COMPUTE_CAPABILITY_PATTERN,
                                           description="CUDA compute capability, e.g. '9.0'; none for AMD GPUs.")
    interconnect: Literal["nvswitch", "pcie", "infinity-fabric"] = Field(
        description="How a node's GPUs talk: NVLink switches, PCIe, AMD's Infinity Fabric.")

    @property
    def compute_capability_pair(self) -> tuple[int, int] | None:
        return capability_pair(self.compute_capability)

"""GPU presets: one TOML data file per GPU under zeroplan/data/gpus/, each citing its datasheet.

`memory_bytes` is the capacity the vendor states, read in the binary (JEDEC) sense that DRAM sizes
use: "80GB HBM3" is 80 GiB = 85,899,345,920 bytes. The driver keeps a little of it (PyTorch's
`total_memory` on an H100 80GB is about 79.1 GiB); where a public report of that figure was found,
the file records it as `reported_total_gib` for comparison. Fitting uses `memory_bytes`; the plan's
headroom (5% by default) is larger than that gap.

`architecture` and `compute_capability` (NVIDIA's CUDA GPUs table) decide what lives outside the
allocator: the CUDA context measured on that architecture, cuBLAS's workspace size
(zeroplan/estimate/device/outside.py); `interconnect` follows from the links the preset has.

Bandwidths are the datasheet figures in GB/s (10^9 bytes/s), as the vendor prints them: NVLink,
Infinity Fabric and PCIe are bidirectional totals, so one direction is half (`*_one_way_bytes_per_s`).
"""

# No `from __future__ import annotations` here: pydantic would compile each field's annotation string
# (typing.ForwardRef) as the models are built, 2 ms of every command's start-up (bench/estimate_speed.py).

import difflib
from functools import lru_cache
from importlib import resources

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from zeroplan.errors import SpecError
from zeroplan.spec.gpu import COMPUTE_CAPABILITY_PATTERN, Architecture, GpuSpec, capability_pair

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

_GB = 10**9


class GpuPreset(BaseModel):
    """One GPU model, as its vendor's datasheet describes it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Preset name used with --gpu, e.g. h100-80gb.")
    label: str = Field(description="Vendor's product name.")
    stated_memory: str = Field(description="Memory exactly as the datasheet prints it, e.g. '80GB HBM3'.")
    memory_bytes: int = Field(ge=1, description="That capacity in bytes (binary reading: 80GB HBM = 80 GiB).")
    reported_total_gib: float | None = Field(
        None, description="Cross-check: torch.cuda total memory (GiB) seen in a public report, if found."
    )
    reported_source: str | None = Field(None, description="Where reported_total_gib was seen.")
    bf16_tflops: float = Field(gt=0, description="Peak dense BF16 tensor throughput, TFLOPS (no sparsity).")
    hbm_bandwidth_gbps: float = Field(gt=0, description="Device memory bandwidth, GB/s.")
    nvlink_bandwidth_gbps: float = Field(
        ge=0, description="GPU-to-GPU link bandwidth (NVLink / Infinity Fabric), GB/s both directions; 0 = none."
    )
    pcie_bandwidth_gbps: float = Field(gt=0, description="Host link bandwidth (PCIe), GB/s both directions.")
    source: str = Field(description="Datasheet the figures come from.")
    architecture: Architecture = Field(
        description="GPU architecture (NVIDIA's marketing generation, AMD's CDNA generation).")
    compute_capability: str | None = Field(
        None, pattern=COMPUTE_CAPABILITY_PATTERN, description="CUDA compute capability, e.g. '9.0'; none for AMD GPUs.")

    @property
    def compute_capability_pair(self) -> tuple[int, int] | None:
        return capability_pair(self.compute_capability)

    @property
    def interconnect(self) -> str:
        """How GPUs of a node talk: nvswitch (the SXM presets sit on NVLink switch boards), pcie
        (no NVLink), infinity-fabric (AMD)."""
        if self.architecture == "cdna3":
            return "infinity-fabric"
        return "nvswitch" if self.nvlink_bandwidth_gbps > 0 else "pcie"

    def spec(self) -> GpuSpec:
        """What the estimate needs of this GPU (zeroplan/spec/gpu.py)."""
        return GpuSpec(name=self.name, memory_bytes=self.memory_bytes, architecture=self.architecture,
                       compute_capability=self.compute_capability, interconnect=self.interconnect)

    @property
    def bf16_flops_per_s(self) -> float:
        return self.bf16_tflops * 1e12

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_bandwidth_gbps * _GB

    @property
    def gpu_link_one_way_bytes_per_s(self) -> float:
        """Intra-node GPU-to-GPU bandwidth in one direction; PCIe when there is no NVLink."""
        link = self.nvlink_bandwidth_gbps or self.pcie_bandwidth_gbps
        return link * _GB / 2

    @property
    def pcie_one_way_bytes_per_s(self) -> float:
        return self.pcie_bandwidth_gbps * _GB / 2


@lru_cache(maxsize=1)
def _presets() -> dict[str, GpuPreset]:
    presets = {}
    for entry in resources.files("zeroplan").joinpath("data", "gpus").iterdir():
        if not entry.name.endswith(".toml"):
            continue
        try:
            preset = GpuPreset.model_validate(tomllib.loads(entry.read_text(encoding="utf-8")))
        except (tomllib.TOMLDecodeError, ValidationError) as error:  # a packaging bug, not user input
            raise RuntimeError(f"GPU preset {entry.name} is invalid: {error}") from error
        presets[preset.name] = preset
    return presets


def gpu_names() -> tuple[str, ...]:
    """Names of every preset, sorted."""
    return tuple(sorted(_presets()))


def all_gpus() -> tuple[GpuPreset, ...]:
    """Every preset, smallest memory first."""
    return tuple(sorted(_presets().values(), key=lambda gpu: (gpu.memory_bytes, gpu.name)))


def get_gpu(name: str) -> GpuPreset:
    """The preset called `name` (case-insensitive); a SpecError naming close matches otherwise."""
    presets = _presets()
    key = name.strip().lower()
    if key in presets:
        return presets[key]
    close = difflib.get_close_matches(key, presets, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise SpecError(f"--gpu: unknown GPU {name!r}{hint} (known: {', '.join(sorted(presets))})")

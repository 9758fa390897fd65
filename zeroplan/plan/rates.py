"""The rates the step-time model divides by (zeroplan/plan/step_time.py), each with its source.

A GPU's memory, datasheet peak and bandwidths come from its preset (zeroplan/data/gpus/); its
compute rates from zeroplan/data/gpu_speeds/ (one file per preset, each figure sourced there):
- the maximum achievable matmul rate (MAMF, measured over many torch.mm shapes) in bf16 (and FP8, for reference);
- the speed of a float8 linear over a bf16 one, casts and scaling included (torchao's measurement);
- the FlashAttention utilisation of the GPU (forward and backward);
- the model FLOPs utilisation a well-tuned training step reaches on the GPU kind (`step_mfu`),
  from a published run that the published throughput table (tests/data/throughput.toml) does not
  contain, so that the table tests it.
The cluster figures (network per GPU, CPU memory and NVMe bandwidth per node) are typical values
with their sources. Every rate is overridable from the CLI; `calibration` rescales the compute
efficiency from a measured step (`zeroplan.plan.calibrate`). docs/throughput.md derives the model.
"""

# No `from __future__ import annotations` here: pydantic would compile each field's annotation string
# (typing.ForwardRef) as the models are built, 2 ms of every command's start-up (bench/estimate_speed.py).

from functools import lru_cache
from importlib import resources

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from zeroplan.errors import FieldError

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

_GB = 10**9
_TFLOPS = 10**12

COMPILE_SPEEDUP = 1.165
"""torch.compile's rate on a step's compute: "torch.compile improves training MFU between 10% and 23% for
various model sizes" (PyTorch blog, Maximizing training throughput using PyTorch FSDP and torch.compile,
2024, IBM and Meta): the middle of that range."""


class GpuSpeeds(BaseModel):
    """Compute rates of one GPU preset, as zeroplan/data/gpu_speeds/NAME.toml states them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="The GPU preset these rates belong to (zeroplan/data/gpus/).")
    fp32_tflops: float = Field(gt=0, description="Peak FP32 (CUDA-core) TFLOPS, the datasheet's.")
    fp32_source: str
    matmul_bf16_tflops: float = Field(gt=0, description="Maximum achievable bf16 matmul TFLOPS (measured).")
    matmul_fp8_tflops: float = Field(ge=0, description="Maximum achievable FP8 matmul TFLOPS (0: none measured).")
    matmul_source: str
    float8_linear_speedup: float = Field(ge=0, description="A float8 linear's speed over a bf16 one, casts included (0: none).")
    float8_source: str
    attention_utilization: float = Field(gt=0, le=1, description="FlashAttention forward+backward share of peak.")
    attention_source: str
    step_mfu: float = Field(gt=0, le=1, description="Model FLOPs utilisation of a well-tuned training step.")
    step_source: str


@lru_cache(maxsize=1)
def _speeds() -> dict[str, GpuSpeeds]:
    found = {}
    for entry in resources.files("zeroplan").joinpath("data", "gpu_speeds").iterdir():
        if entry.name.endswith(".toml"):
            try:
                speeds = GpuSpeeds.model_validate(tomllib.loads(entry.read_text(encoding="utf-8")))
            except (tomllib.TOMLDecodeError, ValidationError) as error:  # a packaging bug, not user input
                raise RuntimeError(f"GPU speeds {entry.name} are invalid: {error}") from error
            found[speeds.name] = speeds
    return found


def gpu_speeds(name: str) -> GpuSpeeds:
    """The compute rates of preset `name` (every preset has a file; tests/plan/test_step_time.py checks)."""
    return _speeds()[name]


class Rates(BaseModel):
    """What one GPU and its cluster do per second, and the program knobs that change it (not memory)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu_flops_per_s: float = Field(gt=0, description="Peak dense BF16 FLOP/s of one GPU (datasheet).")
    fp32_flops_per_s: float = Field(gt=0, description="Peak FP32 FLOP/s (datasheet): the peak of an fp32 run.")
    matmul_flops_per_s: float = Field(gt=0, description="Maximum achievable bf16 matmul FLOP/s (measured).")
    float8_linear_speedup: float = Field(0.0, ge=0, description="A float8 linear's speed over a bf16 one, casts and "
                                         "scaling included, measured (0: none measured, float8 refused).")
    step_efficiency: float = Field(gt=0, le=1, description="Model FLOPs utilisation of a well-tuned step's compute.")
    attention_utilization: float = Field(gt=0, le=1, description="FlashAttention forward+backward share of peak.")
    hbm_bytes_per_s: float = Field(gt=0, description="GPU memory bandwidth, bytes/s (datasheet).")
    intra_node_bytes_per_s: float = Field(
        gt=0, description="GPU-to-GPU bandwidth inside a node, one direction, bytes/s (NVLink: half the datasheet total)."
    )
    inter_node_bytes_per_s: float = Field(
        50 * _GB, gt=0,
        description="Network bandwidth per GPU between nodes, one direction: 400 Gb/s = 50 GB/s, one ConnectX-7 "
        "InfiniBand NDR port per GPU as in NVIDIA DGX H100.",
    )
    pcie_bytes_per_s: float = Field(gt=0, description="GPU-host bandwidth, one direction, bytes/s (PCIe, half the datasheet total).")
    cpu_memory_bytes_per_s: float = Field(
        300 * _GB, gt=0,
        description="CPU memory bandwidth per node, bytes/s: two sockets of 8-channel DDR5-4800 give about 600 GB/s "
        "peak (8 x 4800 MT/s x 8 bytes x 2); half of peak is assumed reachable by CPU Adam.",
    )
    nvme_bytes_per_s: float = Field(
        7 * _GB, gt=0,
        description="NVMe bandwidth per node, bytes/s: one PCIe Gen4 SSD, about 7 GB/s sequential "
        "(e.g. Samsung 990 PRO datasheet: 7,450 MB/s read).",
    )
    ring_base_latency_s: float = Field(
        8.4e-6, ge=0, description="Latency of launching one ring collective (NCCL src/graph/tuning.cc baseLat, Ring, "
        "Simple protocol: 8.4 us).")
    ring_step_latency_intra_s: float = Field(
        3.4e-6, ge=0, description="Latency of one ring step over NVLink (NCCL tuning.cc hwLat, NVLink, Ring, Simple: 3.4 us).")
    ring_step_latency_inter_s: float = Field(
        14e-6, ge=0, description="Latency of one ring step over the network (NCCL tuning.cc hwLat, NET, Ring, Simple: 14 us).")
    compile: bool = Field(False, description="torch.compile on the model: its compute runs COMPILE_SPEEDUP faster.")
    float8: bool = Field(False, description="float8 linears (torchao): their matmuls at the FP8 matmul rate.")
    async_tp: bool = Field(False, description="Async tensor parallelism: TP collectives overlap the block's matmuls.")
    calibration: float = Field(1.0, gt=0, description="Scale of the compute efficiency from a measured step (--calibrate).")
    source: str = Field("", description="Where the GPU figures come from.")

    @property
    def matmul_efficiency(self) -> float:
        """The bf16 matmul rate a GPU can reach, as a share of its peak."""
        return min(1.0, self.matmul_flops_per_s / self.gpu_flops_per_s)


DEFAULT_SPEEDS_GPU = "h100-80gb"
"""The preset whose speeds are assumed when only a GPU memory size is given."""

_RATES_AS_TYPED = {
    "gpu_tflops": ("gpu_flops_per_s", _TFLOPS),
    "intra_node_gbps": ("intra_node_bytes_per_s", _GB),
    "inter_node_gbps": ("inter_node_bytes_per_s", _GB),
    "pcie_gbps": ("pcie_bytes_per_s", _GB),
    "cpu_memory_gbps": ("cpu_memory_bytes_per_s", _GB),
    "nvme_gbps": ("nvme_bytes_per_s", _GB),
    "max_efficiency": ("step_efficiency", 1),
}
"""Rates in the units users type (TFLOP/s, GB/s, a fraction) -> the Rates field and its scale."""


def rates_for(gpu, **overrides) -> Rates:
    """Rates of a `GpuPreset` (DEFAULT_SPEEDS_GPU's, said in `source`, when `gpu` is None), with `overrides` on
    top: Rates fields, or the rates of `_RATES_AS_TYPED` in TFLOP/s, GB/s or a fraction; None means not given.
    A peak given (gpu_tflops) scales the measured matmul rates with it (the same kernels on a slower clock)."""
    from zeroplan.importers.gpus import get_gpu

    if gpu is None:
        gpu = get_gpu(DEFAULT_SPEEDS_GPU)
        source = f"no --gpu given: speeds of {gpu.label} assumed ({gpu.source})"
    else:
        source = f"{gpu.label}: {gpu.source}"
    speeds = gpu_speeds(gpu.name)
    values = {
        "gpu_flops_per_s": gpu.bf16_flops_per_s,
        "fp32_flops_per_s": speeds.fp32_tflops * _TFLOPS,
        "matmul_flops_per_s": speeds.matmul_bf16_tflops * _TFLOPS,
        "float8_linear_speedup": speeds.float8_linear_speedup,
        "step_efficiency": speeds.step_mfu,
        "attention_utilization": speeds.attention_utilization,
        "hbm_bytes_per_s": gpu.hbm_bytes_per_s,
        "intra_node_bytes_per_s": gpu.gpu_link_one_way_bytes_per_s,
        "pcie_bytes_per_s": gpu.pcie_one_way_bytes_per_s,
        "source": source,
    }
    for name, value in overrides.items():
        if value is None:
            continue
        if name in _RATES_AS_TYPED:
            name, scale = _RATES_AS_TYPED[name]
            value = value * scale
        if name == "gpu_flops_per_s":
            clock = value / values["gpu_flops_per_s"]
            for scaled in ("fp32_flops_per_s", "matmul_flops_per_s"):
                values[scaled] *= clock
        values[name] = value
    if values.get("float8") and not values["float8_linear_speedup"]:
        known = ", ".join(name for name, speed in sorted(_speeds().items()) if speed.float8_linear_speedup)
        raise FieldError("float8", f"no measured float8 linear speedup for {gpu.name} (known for {known})")
    return Rates.model_validate(values)

"""Options of the step-time model, shared by `plan` and `estimate --gpu`: rate overrides, the program knobs that
change speed but not memory (torch.compile, float8, async TP), and a calibration from a measured step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from zeroplan.cli.types import FiniteFloatRange

F = TypeVar("F", bound=Callable[..., Any])


def _rate(name: str, field: str, unit: str, help_text: str):
    return click.option(name, field, type=FiniteFloatRange(min=0, min_open=True), metavar=unit, help=help_text)


STEP_OPTIONS = [
    _rate("--gpu-tflops", "gpu_tflops", "TFLOPS", "Override the GPU's dense BF16 peak (its measured matmul rates scale with it)."),
    _rate("--gpu-link-bandwidth", "intra_node_gbps", "GB/s", "GPU-to-GPU bandwidth inside a node, one direction [default: half the preset's NVLink]."),
    _rate("--network-bandwidth", "inter_node_gbps", "GB/s", "Network bandwidth per GPU between nodes, one direction [default: 50]."),
    _rate("--pcie-bandwidth", "pcie_gbps", "GB/s", "GPU-host bandwidth, one direction [default: half the preset's PCIe]."),
    _rate("--cpu-memory-bandwidth", "cpu_memory_gbps", "GB/s", "CPU memory bandwidth per node for the offloaded optimizer [default: 300]."),
    _rate("--nvme-bandwidth", "nvme_gbps", "GB/s", "NVMe bandwidth per node [default: 7]."),
    click.option("--max-efficiency", type=FiniteFloatRange(0, 1, min_open=True),
                 help="Model FLOPs utilisation of a well-tuned step's compute on this GPU [default: the GPU's published "
                 "MFU, zeroplan/data/gpu_speeds/]."),
    click.option("--compile/--no-compile", "compile_model", default=False, show_default=True,
                 help="torch.compile on the model: its compute priced 1.165x faster (docs/throughput.md). Speed only."),
    click.option("--float8", is_flag=True, default=False,
                 help="float8 linears (torchao): the blocks' matmuls at the GPU's measured FP8 rate. Speed only: memory is "
                 "estimated in the run's precision."),
    click.option("--async-tp", is_flag=True, default=False,
                 help="Async tensor parallelism: TP collectives overlap the block's matmuls."),
    click.option("--calibrate", "calibrate_file", type=click.Path(exists=True, dir_okay=False), metavar="MEASURE.json",
                 help="Rescale the compute efficiency so that the configuration of a `zeroplan measure --output` file "
                 "is priced at its measured step time (the same model)."),
]


def step_options(function: F) -> F:
    for decorator in reversed(STEP_OPTIONS):
        function = decorator(function)
    return function


ESTIMATE_STEP_OPTIONS = [
    click.option("--gpu", "gpu", metavar="NAME", help="GPU preset (memory, FLOP/s, bandwidths from its datasheet): also "
                 "prices the step (`step` in the JSON, a line under the table). a100-40gb, a100-80gb, h100-80gb, "
                 "h200-141gb, l4-24gb, rtx3090-24gb, rtx4090-24gb, mi300x-192gb."),
] + STEP_OPTIONS


def estimate_step_options(function: F) -> F:
    """--gpu NAME and the step-time options, for `zeroplan estimate`."""
    for decorator in reversed(ESTIMATE_STEP_OPTIONS):
        function = decorator(function)
    return function

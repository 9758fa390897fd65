"""Options of the step-time model, shared by `plan` and `estimate --gpu`: rate overrides, the program knobs that
change speed but not memory (torch.compile, float8, async TP), and a calibration from a measured step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from zeroplan.cli.common import FiniteFloatRange

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


def rates_from_options(options: dict, preset, model) -> tuple[Any, tuple[str, ...]]:
    """The step-time rates of `preset` (None: the default preset's speeds) with the options' overrides and knobs,
    calibrated when --calibrate is given; and the notes to print (the calibration's)."""
    from zeroplan.plan.rates import rates_for

    names = ("gpu_tflops", "intra_node_gbps", "inter_node_gbps", "pcie_gbps", "cpu_memory_gbps", "nvme_gbps",
             "max_efficiency")
    rates = rates_for(preset, **{name: options.get(name) for name in names}, compile=options.get("compile_model"),
                      float8=options.get("float8"), async_tp=options.get("async_tp"))
    if not options.get("calibrate_file"):
        return rates, ()
    from zeroplan.plan.calibrate import calibrate, read_measurement

    found = calibrate(model, read_measurement(options["calibrate_file"]), rates)
    return rates.model_copy(update={"calibration": found.factor}), (found.note,)


ESTIMATE_STEP_OPTIONS = [
    click.option("--gpu", "gpu", metavar="NAME", help="GPU preset (memory, FLOP/s, bandwidths from its datasheet): also "
                 "prices the step (`step` in the JSON, a line under the table). a100-40gb, a100-80gb, h100-80gb, "
                 "h200-141gb, l4-24gb, rtx4090-24gb, mi300x-192gb."),
] + STEP_OPTIONS


def estimate_step_options(function: F) -> F:
    """--gpu NAME and the step-time options, for `zeroplan estimate`."""
    for decorator in reversed(ESTIMATE_STEP_OPTIONS):
        function = decorator(function)
    return function


def priced(data: dict, model, training, preset, gpu_memory: int | None, options: dict) -> list[str]:
    """Add `step` (with --gpu) and, when the peak does not fit the GPU's memory, `suggestions` to an estimate's JSON
    `data`; the lines to print under its table."""
    from zeroplan.plan.serialize import step_to_dict, suggestions_to_dict
    from zeroplan.report.plan import step_line, suggestion_lines

    lines: list[str] = []
    if preset is not None:
        from zeroplan.plan.step_time import step_time

        rates, notes = rates_from_options(options, preset, model)
        data["step"] = step_to_dict(step_time(model, training, rates), rates)
        lines.append(step_line(data["step"]))
        lines.extend(f"note: {note}" for note in notes)
    if gpu_memory is not None and data["per_gpu"]["peak"] > gpu_memory:
        from zeroplan.plan.suggest import suggest_changes

        data["suggestions"] = suggestions_to_dict(suggest_changes(model, training, gpu_memory))
        lines.extend(suggestion_lines(data["suggestions"], options["units"]))
    return lines

"""Options shared by `compare` and `plan`, which search over lists where `estimate` takes one value.

They reuse the estimate option group (zeroplan.cli.common) minus the options they turn into
lists (--gpus 8,64, --zero 0,1,2,3, ...), and add the GPU preset and the headroom.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import click

from zeroplan.cli.common import GPU_MEMORY_OPTION, MODEL_OPTIONS, OUTPUT_OPTIONS, TRAINING_OPTIONS, names_sources
from zeroplan.cli.mesh_options import MESH_OPTIONS
from zeroplan.cli.types import FiniteFloatRange
from zeroplan.errors import SpecError

F = TypeVar("F", bound=Callable[..., Any])


def _option_name(decorator: Callable) -> str:
    """The parameter name a click option decorator declares (applied to a throwaway function)."""

    def probe() -> None: ...

    decorator(probe)
    return probe.__click_params__[-1].name  # type: ignore[attr-defined]


def estimate_option_list_except(names: Iterable[str]) -> list[Callable[[F], F]]:
    """MODEL and the training options of `zeroplan estimate`, except those in `names`."""
    excluded = set(names)
    return [d for d in MODEL_OPTIONS + TRAINING_OPTIONS if _option_name(d) not in excluded]


def estimate_options_except(names: Iterable[str]) -> Callable[[F], F]:
    """MODEL and the training options of `zeroplan estimate`, except those in `names`, as one decorator."""
    kept = estimate_option_list_except(names)

    def apply(function: F) -> F:
        function = names_sources(function)
        for decorator in reversed(kept):
            function = decorator(function)
        return function

    return apply


GPU_OPTIONS = [
    click.option("--gpu", "gpu", metavar="NAME", help="GPU preset (memory, FLOP/s, bandwidths from its datasheet): "
                 "a100-40gb, a100-80gb, h100-80gb, h200-141gb, l4-24gb, rtx3090-24gb, rtx4090-24gb, mi300x-192gb."),
    GPU_MEMORY_OPTION,
]
"""--gpu NAME (a preset: memory and, for plan, speeds) or --gpu-memory SIZE|NAME (memory only)."""


def gpu_memory_options(function: F) -> F:
    """GPU_OPTIONS as one decorator."""
    for decorator in reversed(GPU_OPTIONS):
        function = decorator(function)
    return function


def compare_option_list() -> list[Callable[[F], F]]:
    """Every option of `zeroplan compare` (also what `zeroplan.compare(...)` reads its keyword arguments by)."""
    return [
        *estimate_option_list_except({"gpus", "zero_stage", "offload_optimizer", "offload_params", "gpu_memory"}),
        click.option("--zero", "zero_stages", default="0,1,2,3", show_default=True, metavar="LIST",
                     help="ZeRO stages to compare, e.g. 0,1,2,3."),
        click.option("--gpus", "gpu_counts", default="8", show_default=True, metavar="N|LIST|A-B",
                     help="GPU counts to compare: a count, a list (8,64) or a doubling range (8-64 = 8,16,32,64)."),
        click.option("--offload", "offloads", default="none", show_default=True, metavar="LIST",
                     help="Offload choices: none, cpu, nvme (optimizer states at stages 1-2, optimizer states and "
                          "parameters at stage 3), cpu-optimizer, nvme-optimizer (optimizer states only, any stage >= 1)."),
        *GPU_OPTIONS,
        click.option("--headroom", type=FiniteFloatRange(0, 1, max_open=True), default=0.0, show_default=True,
                     help="Fraction of GPU memory to keep free when deciding whether a config fits."),
        *MESH_OPTIONS,
        click.option("--plot", "plot_file", type=click.Path(dir_okay=False), metavar="FILE.png",
                     help="Also draw the per-GPU breakdown as stacked bars (needs matplotlib: pip install 'zeroplan[plot]')."),
        *OUTPUT_OPTIONS,
    ]


def list_items(text: str, field: str) -> tuple[str, ...]:
    """'8, 16' -> ('8', '16'); an empty item ('8,,16') or a repeated one is a mistake, not a value to skip."""
    items = tuple(part.strip() for part in str(text).split(","))
    if not any(items):
        raise SpecError(f"{field}: empty list")
    if "" in items:
        raise SpecError(f"{field}: empty item in {text!r}; write a comma-separated list such as 8,16")
    repeated = sorted({item for item in items if items.count(item) > 1})
    if repeated:
        raise SpecError(f"{field}: {', '.join(repeated)} listed more than once in {text!r}")
    return items


def parse_int_list(text: str, field: str, low: int = 0, high: int | None = None) -> tuple[int, ...]:
    """'0,1,2,3' -> (0, 1, 2, 3), each checked against [low, high]."""
    try:
        values = tuple(int(part) for part in list_items(text, field))
    except ValueError:
        raise SpecError(f"{field}: cannot read {text!r}; write a comma-separated list such as 0,1,2,3") from None
    if len(set(values)) < len(values):
        raise SpecError(f"{field}: a value is listed more than once in {text!r}")
    for value in values:
        if value < low or (high is not None and value > high):
            bound = f"{low}-{high}" if high is not None else f">= {low}"
            raise SpecError(f"{field}: {value} is out of range ({bound})")
    return values


def parse_choice_list(text: str, field: str, choices: Iterable[str]) -> tuple[str, ...]:
    """'none,cpu' -> ('none', 'cpu'), each one of `choices`."""
    allowed = tuple(choices)
    values = list_items(text, field)
    for value in values:
        if value not in allowed:
            raise SpecError(f"{field}: unknown choice {value!r}; use {', '.join(allowed)}")
    return values


def resolve_gpu(name: str | None, memory_bytes: int | None):
    """(preset or None, GPU memory in bytes or None) from --gpu or --gpu-memory (one of them: both
    name the memory, and silently preferring one would answer for a GPU the user did not mean)."""
    if name is None:
        return None, memory_bytes
    if memory_bytes is not None:
        raise SpecError("--gpu and --gpu-memory both give the GPU's memory; give one of them")
    from zeroplan.importers.gpus import get_gpu

    preset = get_gpu(name)
    return preset, preset.memory_bytes


def base_training(options: dict, stages: Iterable[int], gpus: int, model):
    """The TrainingSpec the grid varies: the options and --config at `gpus` GPUs, with the first of
    the searched `stages` the engine accepts (fsdp2 has no stage 0 or 1, torch no stage 2 or 3),
    so that the base validates before the grid replaces its stage. `model` fills the config's "auto" values."""
    from zeroplan.importers.options import training_spec_from_options

    first_error = None
    for stage in stages:
        try:
            return training_spec_from_options({**options, "gpus": gpus, "zero_stage": stage}, options["config_file"], model)
        except SpecError as error:
            first_error = first_error or error
    raise first_error

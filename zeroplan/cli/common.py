"""Options shared by the commands that estimate (estimate, compare, plan, measure), as decorators.

Training options carry the names of the TrainingSpec fields they set (`--zero` -> zero_stage) and
default to None ("not given"), so that `zeroplan.importers.options.training_spec_from_options` can lay them
over a `--config` file and the spec's defaults. Help texts are the spec's field descriptions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, get_args

import click

from zeroplan.cli.lora_options import LORA_OPTIONS
from zeroplan.cli.types import FiniteFloatRange
from zeroplan.errors import FieldError, SpecError, ZeroplanError
from zeroplan.report.common import REPORT_FORMATS
from zeroplan.spec.program import ActivationOffload, GradSync, Loss, ModelInit, OptimizerImpl, Recipe
from zeroplan.spec.training import (
    Attention,
    Checkpointing,
    Device,
    Engine,
    Offload,
    Optimizer,
    Precision,
    TrainingSpec,
)
from zeroplan.spec.fsdp1 import BackwardPrefetch, FSDP1Knobs
from zeroplan.spec.program import FSDP2Units
from zeroplan.spec.training import FREEZE_GROUPS, Float8Knobs, FSDP2Knobs
from zeroplan.spec.limits import field_bounds
from zeroplan.spec.units import REPORT_UNITS, REPORT_UNITS_HELP

F = TypeVar("F", bound=Callable[..., Any])

OPTION_OF_FIELD = {
    "gpu_counts": "--gpus",
    "stages": "--zero",
    "offloads": "--offload",
    "headroom": "--headroom",
    "global_batch": "--global-batch",
    "checkpointing": "--checkpointing", "calibrate": "--calibrate", "float8": "--float8",
    "lora.targets": "--lora-targets", "lora.rank": "--lora-rank", "lora.modules_to_save": "--modules-to-save",
}
"""The option that sets each field a library function names in a `FieldError` (the library knows
no command line)."""


def user_message(error: ZeroplanError, options: Mapping[str, Any] | None = None) -> str:
    """The error as a user of the command line reads it: a library field named by its option, or, where a
    file gave the value (`options`: the command's), by the file and its key."""
    if isinstance(error, FieldError):
        if options is not None:
            from zeroplan.importers.lora_options import lora_field_source

            source = lora_field_source(error.field, options)
            if source is not None:
                return f"{source}: {error.problem}"
        if error.field in OPTION_OF_FIELD:
            return f"{OPTION_OF_FIELD[error.field]}: {error.problem}"
    return str(error)


def names_sources(function: F) -> F:
    """A command whose library errors name a field by where its value came from: the option, or the file
    and key (a --lora adapter_config.json's `r`), which only the command's options tell."""

    @functools.wraps(function)
    def command(**options: Any) -> Any:
        try:
            return function(**options)
        except FieldError as error:
            raise SpecError(user_message(error, options)) from None

    return command  # type: ignore[return-value]


class CountType(click.ParamType):
    """A whole positive count: 6738415616, 7.5e9, 7B, 125M."""

    name = "N"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        from zeroplan.importers.options import parse_count

        try:
            return parse_count(value, param.opts[0] if param else "count")
        except ZeroplanError as error:
            self.fail(str(error).split(": ", 1)[-1], param, ctx)


class GpuMemoryType(click.ParamType):
    """A memory size (80GiB, 40GB, 24e9 bytes) or a GPU preset name (h100-80gb)."""

    name = "SIZE|GPU"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        from zeroplan.importers.options import gpu_memory_bytes

        try:
            return gpu_memory_bytes(value, param.opts[0] if param else "size")
        except ZeroplanError as error:
            self.fail(str(error).split(": ", 1)[-1], param, ctx)


def _help(field: str) -> str:
    """The spec field's description, with its default where it has a fixed one."""
    info = TrainingSpec.model_fields[field]
    if info.default is None:  # e.g. gpus_per_node: the description says what None means
        return str(info.description)
    default = info.default.value if hasattr(info.default, "value") else info.default
    return f"{info.description} [default: {default}]"


def _choice(enum: type) -> click.Choice:
    return click.Choice([member.value for member in enum])


def _apply(decorators: list[Callable[[F], F]], function: F) -> F:
    """The options, on a command that names its errors' sources (`names_sources`)."""
    function = names_sources(function)
    for decorator in reversed(decorators):
        function = decorator(function)
    return function


def _fsdp2_help(knob: str) -> str:
    """An FSDP2 knob's description (engine fsdp2 only)."""
    return f"Engine fsdp2: {FSDP2Knobs.model_fields[knob].description}"


def _count(field: str) -> click.IntRange:
    """The range of a TrainingSpec count, as the spec bounds it (zeroplan/spec/limits.py)."""
    return click.IntRange(*field_bounds(TrainingSpec, field))


# --compile: torchtitan's [compile] components (TrainingSpec.compile), none for eager
COMPILE_CHOICES = {"none": (), "model": ("model",), "loss": ("loss",), "model,loss": ("model", "loss")}


def _compiled(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...] | None:
    return None if value is None else COMPILE_CHOICES[value]


def _float8_values(knob: str) -> list[str]:
    return list(get_args(Float8Knobs.model_fields[knob].annotation))


def _float8_help(knob: str) -> str:
    """A float8 knob's description (with --float8)."""
    return f"With --float8: {Float8Knobs.model_fields[knob].description}"


def _fsdp1_help(knob: str) -> str:
    """An FSDP1 knob's description (engine fsdp1 only), with its fixed default where it has one."""
    info = FSDP1Knobs.model_fields[knob]
    default = "" if info.default is None else f" [default: {str(info.default).lower()}]"
    return f"Engine fsdp1: {info.description}{default}"


def _fsdp1_flag(knob: str) -> Callable[[F], F]:
    """--fsdp1-KNOB/--no-fsdp1-KNOB for a boolean FSDP1 knob, passed on as fsdp1_<knob>."""
    flag = knob.replace("_", "-")
    return click.option(f"--fsdp1-{flag}/--no-fsdp1-{flag}", f"fsdp1_{knob}", default=None, help=_fsdp1_help(knob))


_POSITIVE = click.IntRange(min=1)

MODEL_OPTIONS = [
    click.argument("model", required=False, metavar="[MODEL]"),
    click.option("--params", type=CountType(), help="Estimate a model known by its parameter count only (e.g. 7.5e9, 7B); model states only, no activations. Not with MODEL."),
    click.option("--largest-layer", "largest_layer", type=CountType(), help="With --params: parameters of the largest layer (ZeRO-3 gathers one layer at a time)."),
    click.option("--trainable-params", "trainable_params", type=CountType(), help="With --params: parameters that train (the rest are frozen: no gradients, no optimizer states)."),
]

TRAINING_OPTIONS = [
    click.option("--gpus", "gpus", type=_count("gpus"), help=_help("gpus")),
    click.option("--gpus-per-node", "gpus_per_node", type=_count("gpus_per_node"), help=_help("gpus_per_node")),
    click.option("--zero", "zero_stage", type=click.IntRange(0, 3), metavar="{0,1,2,3}", help=_help("zero_stage")),
    click.option("--offload-optimizer", "offload_optimizer", type=_choice(Offload), help=_help("offload_optimizer")),
    click.option("--offload-params", "offload_params", type=_choice(Offload), help=_help("offload_params")),
    click.option("--precision", "precision", type=_choice(Precision), help=_help("precision")),
    click.option("--optimizer", "optimizer", type=_choice(Optimizer), help=_help("optimizer")),
    click.option("--paged-optimizer/--no-paged-optimizer", "paged_optimizer", default=None, help=_help("paged_optimizer")),
    click.option("--optim", "optim", metavar="NAME", help="The optimizer as TrainingArguments.optim names it "
                 "(adamw_torch, adamw_torch_fused, adamw_bnb_8bit, adamw_8bit, paged_adamw_8bit, paged_adamw_32bit): "
                 "sets --optimizer, --paged-optimizer and --optimizer-impl as the Trainer does. Not with those."),
    click.option("--micro-batch", "micro_batch", type=_count("micro_batch"), help=_help("micro_batch")),
    click.option("--seq-len", "seq_len", type=_count("seq_len"), help=_help("seq_len")),
    click.option("--grad-accum", "grad_accum", type=_count("grad_accum"), help=_help("grad_accum")),
    click.option("--checkpointing", "checkpointing", type=_choice(Checkpointing), help=_help("checkpointing")),
    click.option("--attention", "attention", type=_choice(Attention), help=_help("attention")),
    click.option("--engine", "engine", type=_choice(Engine), help=_help("engine")),
    click.option("--device", "device", type=_choice(Device), help=_help("device")),
    # The training program (zeroplan/spec/program.py): a recipe's defaults, each knob overridable.
    click.option("--recipe", "recipe", type=_choice(Recipe), help=_help("recipe")),
    click.option("--model-init", "model_init", type=_choice(ModelInit), help=_help("model_init")),
    click.option("--dropout", "dropout", type=FiniteFloatRange(0, 1, max_open=True), metavar="P", help=_help("dropout")),
    click.option("--grad-sync", "grad_sync", type=_choice(GradSync), help=_help("grad_sync")),
    click.option("--ddp/--no-ddp", "ddp", default=None, help=_help("ddp")),
    click.option("--optimizer-impl", "optimizer_impl", type=_choice(OptimizerImpl), help=_help("optimizer_impl")),
    click.option("--optimizer-in-backward/--no-optimizer-in-backward", "optimizer_in_backward", default=None,
                 help=_help("optimizer_in_backward")),
    click.option("--loss", "loss", type=_choice(Loss), help=_help("loss")),
    click.option("--loss-chunks", "loss_chunks", type=_count("loss_chunks"), metavar="N", help=_help("loss_chunks")),
    click.option("--activation-offload", "activation_offload", type=_choice(ActivationOffload), help=_help("activation_offload")),
    click.option("--checkpoint-every", "checkpoint_every", type=_count("checkpoint_every"), metavar="N", help=_help("checkpoint_every")),
    # torch.compile and torchao float8 (issue 23): float8 knobs named float8_<knob>, nested by training_spec_from_options
    click.option("--compile", "compile", type=click.Choice(list(COMPILE_CHOICES)), callback=_compiled,
                 help=_help("compile") + " [default: none]"),
    click.option("--float8", "float8_recipe", type=click.Choice(["none", *_float8_values("recipe")]),
                 help="torchao float8 training of the blocks' linears with this scaling recipe (none: off). "
                 + Float8Knobs.model_fields["recipe"].description),
    click.option("--float8-all-gather/--no-float8-all-gather", "float8_fsdp_all_gather", default=None,
                 help=_float8_help("fsdp_all_gather")),
    click.option("--float8-precompute-scale/--no-float8-precompute-scale", "float8_precompute_scale", default=None,
                 help=_float8_help("precompute_scale")),
    click.option("--float8-saved", "float8_saved", type=click.Choice(_float8_values("saved")), help=_float8_help("saved")),
    # FSDP2 wrapping (TrainingSpec.fsdp2, FSDP2Knobs): options named fsdp2_<knob>, nested by training_spec_from_options
    click.option("--fsdp2-units", "fsdp2_units", type=_choice(FSDP2Units), help=_fsdp2_help("units")),
    click.option("--fsdp2-reshard-root/--no-fsdp2-reshard-root", "fsdp2_reshard_root_after_forward", default=None,
                 help=_fsdp2_help("reshard_root_after_forward")),
    click.option("--fsdp2-reshard-head/--no-fsdp2-reshard-head", "fsdp2_reshard_head_after_forward", default=None,
                 help=_fsdp2_help("reshard_head_after_forward")),
    click.option("--fsdp2-reshard-last-block/--no-fsdp2-reshard-last-block", "fsdp2_reshard_last_block", default=None,
                 help=_fsdp2_help("reshard_last_block")),
    # FSDP1 (TrainingSpec.fsdp1, spec/fsdp1.py FSDP1Knobs): options named fsdp1_<knob>, nested as the fsdp2 ones
    _fsdp1_flag("hybrid"),
    _fsdp1_flag("use_orig_params"),
    _fsdp1_flag("limit_all_gathers"),
    click.option("--fsdp1-backward-prefetch", "fsdp1_backward_prefetch", type=_choice(BackwardPrefetch),
                 help=_fsdp1_help("backward_prefetch")),
    _fsdp1_flag("forward_prefetch"),
    _fsdp1_flag("sync_module_states"),
    _fsdp1_flag("cpu_ram_efficient_loading"),
    click.option(
        "--freeze", "freeze", multiple=True, metavar="GROUP",
        type=click.Choice(FREEZE_GROUPS),
        help="Module group that does not train (no gradients, no optimizer states); repeat for several:"
        " embeddings, blocks, final. [default: none]",
    ),
    click.option(
        "--config", "config_file", type=click.Path(exists=True, dir_okay=False), metavar="FILE",
        help="A trainer's config, recognised from its content and never run: a DeepSpeed JSON (\"auto\" values "
        "filled as the Hugging Face Trainer fills them), a torchtitan job TOML (v0.2.2 and earlier), a torchtune "
        "recipe YAML, an accelerate config YAML, or a ColossalAI-style .py. A TOML or torchtune YAML also names "
        "the model. Options given here override it.",
    ),
] + LORA_OPTIONS  # cli/lora_options.py

GPU_MEMORY_OPTION = click.option(
    "--gpu-memory", "gpu_memory", type=GpuMemoryType(),
    help="Memory of one GPU, as a size (80GiB, 40GB) or a GPU name (h100-80gb, a100-40gb, ...); reports whether the peak fits.",
)

def units_option(default: str = "GiB", more_help: str = "") -> Callable[[F], F]:
    """--units, one option for every command (spec/units.py REPORT_UNITS); `default` GiB but where a
    command's figures are a few MiB (validate's tiny models)."""
    return click.option("--units", "units", type=click.Choice(REPORT_UNITS), default=default, show_default=True,
                        help=REPORT_UNITS_HELP + more_help)


OUTPUT_OPTIONS = [
    click.option("--format", "output_format", type=click.Choice(REPORT_FORMATS), default="table", show_default=True, help="Output format; json is a stable contract with sizes in bytes."),
    units_option(),
]


def model_options(function: F) -> F:
    """[MODEL], --params, --largest-layer, --trainable-params (see `zeroplan.importers.options.model_from_options`)."""
    return _apply(MODEL_OPTIONS, function)


def training_options(function: F) -> F:
    """One option per TrainingSpec field, and --config (see `zeroplan.importers.options.training_spec_from_options`)."""
    return _apply(TRAINING_OPTIONS, function)


def apply_options(decorators: list[Callable[[F], F]]) -> Callable[[F], F]:
    """One decorator applying a list of option decorators in their order (the first is the first in --help)."""
    return lambda function: _apply(decorators, function)


def estimate_option_list() -> list[Callable[[F], F]]:
    """Every option of `zeroplan estimate`: model, training, mesh, --gpu-memory, then --format and --units
    (also what `zeroplan.estimate(...)` reads its keyword arguments by: zeroplan/api/keywords.py)."""
    from zeroplan.cli.mesh_options import MESH_OPTIONS
    from zeroplan.cli.plan_options import ESTIMATE_STEP_OPTIONS  # --gpu and the step-time model's (issue 24)

    return MODEL_OPTIONS + TRAINING_OPTIONS + MESH_OPTIONS + [GPU_MEMORY_OPTION] + ESTIMATE_STEP_OPTIONS + OUTPUT_OPTIONS


def output_options(function: F) -> F:
    """--format and --units."""
    return _apply(OUTPUT_OPTIONS, function)

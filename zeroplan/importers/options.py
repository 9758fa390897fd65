"""From what a user typed (command-line options, an engine config file) to validated specs.

The CLI names its training options after the `TrainingSpec` fields they set (`--zero` sets
`zero_stage`, `--micro-batch` sets `micro_batch`); a value of None means "not given". Precedence,
highest first: an explicit option, the `--config` file, the spec's default. Every failure is a
`SpecError` with a one-line message naming the field, so the CLI only has to print it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zeroplan.errors import SpecError
from zeroplan.spec.limits import MAX_COUNT  # a quadrillion parameters; beyond it only typos (1e400)

if TYPE_CHECKING:  # pydantic and the specs are imported when first needed, not at CLI start-up
    from zeroplan.importers.training_config import TrainingConfig
    from zeroplan.spec.model import ModelSpec
    from zeroplan.spec.training import TrainingSpec

_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
_COUNT_PATTERN = re.compile(r"^\s*([0-9][0-9_,]*\.?[0-9]*(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBtT]?)\s*$")


def parse_count(text: str, field: str) -> int:
    """A whole, positive count such as a parameter count: '6738415616', '6_738_415_616', '7.5e9',
    '7B', '125M'. K/M/B/T are 10^3/10^6/10^9/10^12 (counts, not bytes). `field` names the option."""
    match = _COUNT_PATTERN.match(str(text))
    if not match:
        raise SpecError(f"{field}: cannot read count {text!r}; write e.g. 6738415616, 7.5e9 or 7B")
    try:
        # Decimal keeps '6.738415616e9' exact, where float would round it.
        number = Decimal(match.group(1).replace("_", "").replace(",", "")) * _COUNT_SUFFIX[match.group(2).upper()]
    except InvalidOperation:
        raise SpecError(f"{field}: cannot read count {text!r}; write e.g. 6738415616, 7.5e9 or 7B") from None
    if number > MAX_COUNT:
        raise SpecError(f"{field}: {text!r} is more than 10^15; write e.g. 7.5e9 or 70B")
    if number != number.to_integral_value():
        raise SpecError(f"{field}: {text!r} is not a whole number")
    if number < 1:
        raise SpecError(f"{field}: must be at least 1, got {text!r}")
    return int(number)


class GpuMemory(int):
    """A GPU's memory in bytes that remembers the preset it was read from (`gpu`, None for a size): the
    estimate takes the GPU's architecture from it (zeroplan/spec/gpu.py)."""

    gpu: str | None = None

    def __new__(cls, size_bytes: int, gpu: str | None = None) -> GpuMemory:
        value = super().__new__(cls, size_bytes)
        value.gpu = gpu
        return value


def gpu_memory_bytes(text: str, field: str = "--gpu-memory") -> GpuMemory:
    """The memory of one GPU: a size ('80GiB', '40GB', '24e9' bytes) or a GPU preset name
    ('h100-80gb', `zeroplan.importers.gpus`), whose datasheet capacity is used."""
    from zeroplan.spec.units import parse_size_bytes

    try:
        return GpuMemory(parse_size_bytes(text, field))
    except SpecError as size_error:
        from zeroplan.importers.gpus import get_gpu, gpu_names

        if str(text).strip().lower() in gpu_names():
            preset = get_gpu(text)
            return GpuMemory(preset.memory_bytes, preset.name)
        raise SpecError(f"{size_error}, or name a GPU: {', '.join(gpu_names())}") from None


def gpu_spec(gpu: str | None, gpu_memory: int | None):
    """The GPU the run names (zeroplan/spec/gpu.py GpuSpec): a --gpu preset, or the preset --gpu-memory was given
    as; None when neither names one (a size alone, or nothing)."""
    name = gpu or getattr(gpu_memory, "gpu", None)
    if name is None:
        return None
    from zeroplan.importers.gpus import get_gpu  # the presets are read only when a GPU is named

    return get_gpu(name).spec()


HOST_MEMORY_PER_GPU_MEMORY = 2
"""plan's CPU memory per node when --cpu-memory is not given: twice the node's GPU memory. An assumption, stated
in the plan's output and overridable: offload is searched against a host of a server's size, never an unlimited one."""


def host_memory_bytes(text: str | None, gpu_memory_bytes: int, gpus: int, gpus_per_node: int | None = None,
                      field: str = "--cpu-memory") -> tuple[int, str | None]:
    """(CPU memory per node in bytes, the note that states it when it is the default): `text` parsed (a size, as
    --cpu-memory takes it), else HOST_MEMORY_PER_GPU_MEMORY x the GPU memory of a node of `gpus` GPUs."""
    from zeroplan.spec.training import node_size
    from zeroplan.spec.units import parse_size_bytes

    if text is not None:
        return parse_size_bytes(text, field), None
    node_gpus = node_size(gpus, gpus_per_node)
    size = HOST_MEMORY_PER_GPU_MEMORY * gpu_memory_bytes * node_gpus
    return size, (f"CPU memory per node taken as {size / 2**30:,.0f} GiB, twice the GPU memory of a node of {node_gpus} "
                  f"GPU{'s' if node_gpus > 1 else ''} (an assumption for offload); give {field} SIZE for your nodes")


def training_spec_from_options(options: Mapping[str, Any], config_file: str | Path | TrainingConfig | None = None,
                               model: ModelSpec | None = None) -> TrainingSpec:
    """The TrainingSpec for these options over the values read from `config_file`.

    `options` maps TrainingSpec field names to values, None (or an empty tuple, for a repeatable
    option) meaning "not given"; other keys (the CLI passes all of its options) are ignored. `config_file`
    is a trainer config (`zeroplan.importers.training_config.load_training_config`), as a path or
    already loaded; `model` is the model it trains, whose hidden size fills the Hugging Face Trainer's
    "auto" values.
    """
    from pydantic import ValidationError

    from zeroplan.spec.training import FSDP2Knobs, TrainingSpec
    from zeroplan.spec.validation import describe_validation_error

    values: dict[str, Any] = {}
    if config_file is not None:
        config = config_file if not isinstance(config_file, (str, Path)) else load_config(config_file)
        # --gpus lets a DeepSpeed train_batch_size be split into micro-batch and accumulation.
        values.update(config.settings(options.get("gpus"), getattr(model, "hidden_size", None)))
    values.update({name: options[name] for name in TrainingSpec.model_fields
                   if options.get(name) not in (None, ()) and name != "gpu"})
    if options.get("compile") == ():  # --compile none: eager, over a config that compiles
        values["compile"] = ()
    gpu = gpu_spec(options.get("gpu"), options.get("gpu_memory"))  # --gpu NAME, or --gpu-memory NAME
    if gpu is not None:
        values["gpu"] = gpu
    from zeroplan.importers.trainer_optim import optim_values  # --optim: TrainingArguments.optim names

    values.update(optim_values(options))
    from zeroplan.importers.lora_options import lora_values

    values.update(lora_values(options, model, values))  # --lora-*, --base-precision: importers/lora_options.py
    float8_values(options, values)  # --float8 and --float8-* over the config file's float8 settings
    fsdp2 = {knob: options[f"fsdp2_{knob}"] for knob in FSDP2Knobs.model_fields if options.get(f"fsdp2_{knob}") is not None}
    if fsdp2:  # --fsdp2-* options (cli/common.py) over the config file's fsdp2 settings
        values["fsdp2"] = {**(values.get("fsdp2") or {}), **fsdp2}
    from zeroplan.spec.fsdp1 import FSDP1Knobs

    fsdp1 = {knob: options[f"fsdp1_{knob}"] for knob in FSDP1Knobs.model_fields if options.get(f"fsdp1_{knob}") is not None}
    if fsdp1:  # --fsdp1-* options over the config file's fsdp1 settings
        values["fsdp1"] = {**(values.get("fsdp1") or {}), **fsdp1}
    from zeroplan.importers.mesh_options import mesh_values  # --tp, --pp, ... over the config's mesh (issue 14)

    mesh_values(options, values)
    try:
        training = TrainingSpec.model_validate(values)
    except ValidationError as error:
        raise SpecError(describe_validation_error(error, schema=TrainingSpec)) from None
    if model is not None:
        check_model_training(model, training, seq_len_given="seq_len" in values)
    if config_file is not None:
        config.warn()
    return training


def check_model_training(model: ModelSpec, training: TrainingSpec, seq_len_given: bool = True) -> None:
    """The rules that need the model and the run together (the mesh's are spec/mesh.py `check_mesh`).
    `seq_len_given`: the sequence length was asked for (an option, a config file), not the spec's default,
    which a model of fewer learned positions gets a note about instead (`input_notes`)."""
    if getattr(model, "kind", None) != "transformer":
        return
    limit = model.max_position_embeddings
    if model.position_embedding == "learned" and training.seq_len > limit and seq_len_given:
        # GPT2Model.forward: self.wpe(position_ids), an nn.Embedding of n_positions rows: position `limit` has no
        # row (an IndexError on CPU, a device-side assert on CUDA), so the run cannot start
        raise SpecError(f"seq_len {training.seq_len:,}: {model.name} has {limit:,} learned positions "
                        f"(max_position_embeddings), and transformers' position embedding has no row past them; use "
                        f"a sequence of {limit:,} tokens or fewer")


def input_notes(model: ModelSpec, training: TrainingSpec, config: TrainingConfig | None = None,
                model_argument: str | None = None) -> tuple[str, ...]:
    """What the estimate takes as given but the user should hear: what the model file and the --config file
    hold that is not modelled, a sequence past the model's context, and which model wins when MODEL and the
    --config file both name one (`model_argument`: the MODEL typed, None when the file's was used)."""
    notes = list(getattr(model, "notes", ()))
    if config is not None:
        notes += config.notes
        if model_argument is not None and config.model is not None and model.name.lower() != config.model.lower():
            notes.append(f"MODEL {model.name} is estimated, not {config.model}, the model of {config.path.name}: "
                         "MODEL wins over the --config file, as every option does")
    if getattr(model, "kind", None) == "transformer" and training.seq_len > model.max_position_embeddings:
        if model.position_embedding == "learned":  # the default seq_len (an explicit one is refused: check_model_training)
            notes.append(f"seq_len {training.seq_len:,} (the default) is past {model.name}'s "
                         f"{model.max_position_embeddings:,} learned positions (max_position_embeddings): transformers "
                         f"cannot run it; give --seq-len {model.max_position_embeddings} or less")
            return tuple(notes)
        # rotary positions are computed from the position ids (LlamaRotaryEmbedding.forward), never looked up
        notes.append(f"seq_len {training.seq_len:,} is past {model.name}'s max_position_embeddings "
                     f"{model.max_position_embeddings:,}: transformers runs it (rotary positions are computed for any "
                     "length), but the model was not trained on sequences that long")
    return tuple(notes)


def float8_values(options: Mapping[str, Any], values: dict[str, Any]) -> None:
    """Set `values["float8"]` from --float8 RECIPE (none: off) and the --float8-* knobs, over the config file's."""
    from zeroplan.spec.training import Float8Knobs

    recipe = options.get("float8_recipe")
    knobs = {knob: options[f"float8_{knob}"] for knob in Float8Knobs.model_fields
             if knob != "recipe" and options.get(f"float8_{knob}") is not None}
    if recipe == "none":
        if knobs:
            raise SpecError(f"--float8 none turns float8 off; drop --float8-{next(iter(knobs)).replace('_', '-')}")
        values["float8"] = None
        return
    base = values.get("float8")
    if recipe is None and not knobs:
        return
    if recipe is None and base is None:
        raise SpecError(f"--float8-{next(iter(knobs)).replace('_', '-')} sets a knob of float8 training; give --float8 "
                        "RECIPE (tensorwise, rowwise, rowwise_with_gw_hp) too")
    merged = {**(base.model_dump() if hasattr(base, "model_dump") else base or {}), **knobs}
    if recipe is not None:
        merged["recipe"] = recipe
    values["float8"] = merged


def load_config(config_file: str | Path | None) -> TrainingConfig | None:
    """The --config file, read and checked (None when there is none)."""
    if config_file is None:
        return None
    from zeroplan.importers.training_config import load_training_config

    return load_training_config(config_file)


def model_from_options(
    model: str | None,
    params: int | None = None,
    largest_layer: int | None = None,
    trainable_params: int | None = None,
    config: TrainingConfig | None = None,
) -> ModelSpec:
    """The model named by MODEL (a catalogue name, a spec file or a config.json), or one known only
    by its parameter count (`--params`, with `--largest-layer` and `--trainable-params`); without
    either, the model the --config file names (a torchtitan TOML, a torchtune YAML)."""
    if model is None and params is None and config is not None:
        model = config.model
    if model is not None and params is not None:
        raise SpecError(f"MODEL {model!r} and --params given together; give one: a model, or a parameter count")
    if params is None:
        if largest_layer is not None or trainable_params is not None:
            raise SpecError("--largest-layer and --trainable-params describe a --params model; give --params too")
        if model is None:
            raise SpecError(
                "missing MODEL: give a catalogue name (see `zeroplan models`), a spec file or a config.json, or --params N"
                + (f" (the --config file, {config.kind}, names no model)" if config is not None else "")
            )
        from zeroplan.importers.catalog import resolve_model

        return resolve_model(model)
    from zeroplan.importers.catalog import params_model

    return params_model(params, largest_layer, trainable_params)  # a SpecError naming the field when invalid

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

if TYPE_CHECKING:  # pydantic and the specs are imported when first needed, not at CLI start-up
    from zeroplan.importers.training_config import TrainingConfig
    from zeroplan.spec.model import ModelSpec
    from zeroplan.spec.training import TrainingSpec

MAX_COUNT = 10**15  # a quadrillion parameters: 1,000x the largest model trained; beyond it only typos (1e400)
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


def gpu_memory_bytes(text: str, field: str = "--gpu-memory") -> int:
    """The memory of one GPU: a size ('80GiB', '40GB', '24e9' bytes) or a GPU preset name
    ('h100-80gb', `zeroplan.importers.gpus`), whose datasheet capacity is used."""
    from zeroplan.spec.units import parse_size_bytes

    try:
        return parse_size_bytes(text, field)
    except SpecError as size_error:
        from zeroplan.importers.gpus import get_gpu, gpu_names

        if str(text).strip().lower() in gpu_names():
            return get_gpu(text).memory_bytes
        raise SpecError(f"{size_error}, or name a GPU: {', '.join(gpu_names())}") from None


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
    values.update({name: options[name] for name in TrainingSpec.model_fields if options.get(name) not in (None, ())})
    from zeroplan.importers.lora_options import lora_values

    values.update(lora_values(options, model, values))  # --lora-*, --base-precision: importers/lora_options.py
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
    if config_file is not None:
        config.warn()
    return training


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

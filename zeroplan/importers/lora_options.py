"""The LoRA and quantized-base options (zeroplan/cli/lora_options.py) as the TrainingSpec's `lora`
and `quant`; a SpecError names the option that is wrong."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from zeroplan.errors import SpecError
from zeroplan.spec.lora import PEFT_DEFAULT_TARGETS, LoraSpec, QuantSpec, lora_spec_from_adapter_config
from zeroplan.spec.validation import describe_validation_error

_LORA_OPTIONS = {"lora_alpha": "--lora-alpha", "lora_targets": "--lora-targets", "lora_dropout": "--lora-dropout",
                 "dora": "--dora", "modules_to_save": "--modules-to-save"}
_QUANT_OPTIONS = {"double_quant": "--double-quant", "compute_dtype": "--compute-dtype", "quant_storage": "--quant-storage",
                  "upcast_non_quantized": "--upcast-non-quantized", "bits": "--quant-bits", "group_size": "--quant-group-size"}
_OPTION_OF_FIELD = {"rank": "--lora-rank", "alpha": "--lora-alpha", "targets": "--lora-targets",
                    "dropout": "--lora-dropout", "dora": "--dora", "modules_to_save": "--modules-to-save",
                    "base_precision": "--base-precision", "double_quant": "--double-quant",
                    "compute_dtype": "--compute-dtype", "quant_storage": "--quant-storage",
                    "upcast_non_quantized": "--upcast-non-quantized", "bits": "--quant-bits",
                    "group_size": "--quant-group-size"}


def _given(options: Mapping[str, Any], name: str) -> bool:
    return options.get(name) not in (None, ())


def _names(text: str, option: str) -> tuple[str, ...]:
    items = tuple(part.strip() for part in str(text).split(","))
    if "" in items:
        raise SpecError(f"{option}: empty name in {text!r}; write a comma-separated list such as q_proj,v_proj")
    return items


def _validated(schema: type, values: dict[str, Any]) -> Any:
    try:
        return schema.model_validate(values)
    except ValidationError as error:
        message = describe_validation_error(error, schema=schema)
        field = message.split(":", 1)[0]
        if field in _OPTION_OF_FIELD:
            message = _OPTION_OF_FIELD[field] + message[len(field):]
        raise SpecError(message) from None


def lora_values(options: Mapping[str, Any], model: Any = None, config_values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """{"lora": LoraSpec, "quant": QuantSpec} for the options given (neither key when none is);
    `config_values` are what a --config file set for them (torchtune's LoRA recipes)."""
    values: dict[str, Any] = {}
    given = [name for name in _LORA_OPTIONS if _given(options, name)]
    lora_file = options.get("lora_config")
    base = dict(config_values.get("lora") or {}) if config_values else {}
    if lora_file:
        base = lora_spec_from_adapter_config(lora_file).model_dump()
    if _given(options, "lora_rank") or base:
        if model is not None and getattr(model, "kind", None) == "params":
            raise SpecError("--lora-rank: a model known by its parameter count has no layers to adapt; give MODEL")
        lora = dict(base)
        for option, field in (("lora_rank", "rank"), ("lora_alpha", "alpha"), ("lora_dropout", "dropout"), ("dora", "dora")):
            if _given(options, option):  # the option over the adapter_config.json value
                lora[field] = options[option]
        if _given(options, "lora_targets"):
            lora["targets"] = _names(options["lora_targets"], "--lora-targets")
        elif "targets" not in lora:
            lora["targets"] = _default_targets(model)
        if _given(options, "modules_to_save"):
            lora["modules_to_save"] = _names(options["modules_to_save"], "--modules-to-save")
        values["lora"] = _validated(LoraSpec, lora)
    elif given:
        raise SpecError(f"{_LORA_OPTIONS[given[0]]}: LoRA options need --lora-rank R or --lora adapter_config.json")
    quant_given = [name for name in _QUANT_OPTIONS if _given(options, name)]
    config_quant = dict(config_values.get("quant") or {}) if config_values else {}
    if not config_quant and not _given(options, "base_precision"):
        from zeroplan.importers.hf_quant_config import checkpoint_quant  # config.json quantization_config

        config_quant = checkpoint_quant(model) or {}
        if "lora" not in values and config_quant.get("base_precision") in ("bf16", "fp16", "fp32"):
            config_quant = {}  # a dequantized checkpoint trained whole: the engine's dtypes, as any model
        if config_quant and "lora" not in values:
            raise SpecError(f"{model.source}: quantization_config ({config_quant['base_precision']}): a quantized "
                            "checkpoint trains through adapters only: add --lora-rank R, or --base-precision bf16 to "
                            "estimate it dequantized")
    if _given(options, "base_precision") or config_quant:
        if model is not None and getattr(model, "kind", None) == "params":
            raise SpecError("--base-precision: a model known by its parameter count has no layer shapes to quantize; "
                            "give MODEL")
        quant = dict(config_quant)
        if _given(options, "base_precision"):
            quant["base_precision"] = options["base_precision"]
        quant.update({name: options[name] for name in quant_given})
        values["quant"] = _validated(QuantSpec, quant)
    elif quant_given:
        raise SpecError(f"{_QUANT_OPTIONS[quant_given[0]]}: needs --base-precision (nf4 or fp4 for the 4-bit knobs)")
    return values


def _default_targets(model: Any) -> tuple[str, ...]:
    """PEFT's default target_modules for the model type (peft/utils/constants.py)."""
    model_type = getattr(model, "model_type", None)
    if model_type in PEFT_DEFAULT_TARGETS:
        return PEFT_DEFAULT_TARGETS[model_type]
    raise SpecError(f"--lora-targets: PEFT has no default targets for {model_type or 'this model'}; name the modules")


def lora_command_options(training: Any) -> str:
    """The options that give `training`'s LoRA and base storage back to `zeroplan estimate` (for the
    check command `plan --emit` prints: a DeepSpeed JSON carries no adapters)."""
    parts = []
    lora, quant = training.lora, training.quant
    if lora is not None:
        parts += ["--lora-rank", str(lora.rank), "--lora-targets", ",".join(lora.targets)]
        if lora.dropout:
            parts += ["--lora-dropout", str(lora.dropout)]
        if lora.dora:
            parts.append("--dora")
        if lora.modules_to_save:
            parts += ["--modules-to-save", ",".join(lora.modules_to_save)]
    if quant is not None:
        parts += ["--base-precision", quant.base_precision.value]
        if quant.double_quant:
            parts.append("--double-quant")
        if quant.base_precision.is_quantized and quant.compute_dtype != "bf16":
            parts += ["--compute-dtype", quant.compute_dtype]
        if quant.quant_storage != "uint8":
            parts += ["--quant-storage", quant.quant_storage]
        if quant.upcast_non_quantized:
            parts.append("--upcast-non-quantized")
        if quant.base_precision.is_packed_int:
            parts += ["--quant-bits", str(quant.bits), "--quant-group-size", str(quant.group_size)]
    return "".join(f" {part}" for part in parts)


def fsdp2_peft_lines(training: Any) -> list[str]:
    """Comment lines for the FSDP2 snippet of a LoRA plan (importers/fsdp2_snippet.py)."""
    if training.lora is None:
        return []
    lines = [
        "# LoRA: pass the PEFT model (get_peft_model) and its blocks. FSDP2 shards each parameter on its own, so a",
        "# unit may mix frozen base weights and trainable adapters: FSDP1's use_orig_params=True is not needed. The",
        "# optimizer takes the trainable parameters only; frozen ones get no gradient and no state.",
    ]
    quant = training.quant
    if quant is not None and quant.base_precision.is_4bit:
        lines += [
            f"# QLoRA: load with BitsAndBytesConfig(bnb_4bit_quant_storage=torch.{_TORCH_DTYPE[quant.quant_storage]}) so the",
            "# packed 4-bit weights shard as the other parameters do (zeroplan has not run bitsandbytes under FSDP2).",
        ]
    return lines


_TORCH_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "uint8": "uint8"}


# The estimator checks the adapters against the model's layers and names the LoraSpec field that is wrong
# (estimate/lora.py: FieldError("lora.rank"), ...): its name in each place a LoRA comes from.
_FILE_KEYS = {"lora.rank": "r", "lora.targets": "target_modules", "lora.modules_to_save": "modules_to_save"}
_TORCHTUNE_KEYS = {"lora.rank": "model.lora_rank", "lora.targets": "model.lora_attn_modules"}
_FIELD_OPTIONS = {"lora.rank": "lora_rank", "lora.targets": "lora_targets", "lora.modules_to_save": "modules_to_save"}


def lora_field_source(field: str, options: Mapping[str, Any]) -> str | None:
    """Where a LoRA field came from, as the user wrote it: "adapter.json: r" when the --lora file set it and
    no option overrode it, "recipe.yaml: model.lora_rank" for a torchtune recipe's; None for an option."""
    if field not in _FIELD_OPTIONS or _given(options, _FIELD_OPTIONS[field]):
        return None
    if options.get("lora_config") and field in _FILE_KEYS:
        return f"{options['lora_config']}: {_FILE_KEYS[field]}"
    config = options.get("config_file")
    if config is not None and field in _TORCHTUNE_KEYS and not _given(options, "lora_rank"):
        path = getattr(config, "path", config)  # a loaded TrainingConfig, or the path the command was given
        return f"{path}: {_TORCHTUNE_KEYS[field]}"
    return None

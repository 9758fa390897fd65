"""The LoRA and quantized-base options of estimate, compare, plan and measure (issue 12). They
default to None ("not given"); `zeroplan.importers.lora_options.lora_values` turns them into the
TrainingSpec's `lora` and `quant`."""

from __future__ import annotations

import click

from zeroplan.spec.limits import field_bounds
from zeroplan.spec.lora import BasePrecision, LoraSpec, QuantSpec


def _help(model: type, field: str, extra: str = "") -> str:
    return f"{model.model_fields[field].description}{extra}"


LORA_OPTIONS = [
    click.option("--lora-rank", "lora_rank", type=click.IntRange(*field_bounds(LoraSpec, "rank")), metavar="R", help=_help(LoraSpec, "rank", " Turns LoRA on.")),
    click.option("--lora-alpha", "lora_alpha", type=float, metavar="A", help=_help(LoraSpec, "alpha")),
    click.option("--lora-targets", "lora_targets", metavar="NAMES", help="Modules to adapt, comma-separated as PEFT "
                 "names them (q_proj,v_proj; c_attn; query_key_value), or all-linear. [default: PEFT's for the model "
                 "type, e.g. q_proj,v_proj]"),
    click.option("--lora-dropout", "lora_dropout", type=float, metavar="P", help=_help(LoraSpec, "dropout")),
    click.option("--dora/--no-dora", "dora", default=None, help=_help(LoraSpec, "dora")),
    click.option("--modules-to-save", "modules_to_save", metavar="NAMES", help=_help(LoraSpec, "modules_to_save",
                 " Comma-separated (lm_head, embed_tokens).")),
    click.option("--lora", "lora_config", type=click.Path(exists=True, dir_okay=False), metavar="FILE",
                 help="PEFT's adapter_config.json; the --lora-* options override it."),
    click.option("--base-precision", "base_precision", type=click.Choice([p.value for p in BasePrecision]),
                 help=_help(QuantSpec, "base_precision", " [default: the training precision's parameter dtype]")),
    click.option("--double-quant/--no-double-quant", "double_quant", default=None, help=_help(QuantSpec, "double_quant")),
    click.option("--compute-dtype", "compute_dtype", type=click.Choice(["bf16", "fp16", "fp32"]),
                 help=_help(QuantSpec, "compute_dtype", " [default: bf16]")),
    click.option("--quant-storage", "quant_storage", type=click.Choice(["uint8", "bf16", "fp16", "fp32"]),
                 help=_help(QuantSpec, "quant_storage", " [default: uint8]")),
    click.option("--upcast-non-quantized/--no-upcast-non-quantized", "upcast_non_quantized", default=None,
                 help=_help(QuantSpec, "upcast_non_quantized")),
    click.option("--quant-bits", "bits", type=click.IntRange(min=1), help=_help(QuantSpec, "bits", " [default: 4]")),
    click.option("--quant-group-size", "group_size", type=int, help=_help(QuantSpec, "group_size", " [default: 128]")),
]

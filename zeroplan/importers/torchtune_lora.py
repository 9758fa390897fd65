"""torchtune's LoRA and QLoRA recipes (lora_finetune_single_device / _distributed) as zeroplan's
`lora` and `quant` (issue 12). The model builder `torchtune.models.<family>.lora_<name>` (or
`qlora_<name>`, which sets quantize_base) takes the adapter settings as arguments (torchtune 0.6.1
torchtune/models/llama3/_component_builders.py `lora_llama3`): lora_attn_modules, apply_lora_to_mlp,
apply_lora_to_output, lora_rank, lora_alpha, lora_dropout, use_dora, quantize_base."""

from __future__ import annotations

from collections.abc import Mapping

from zeroplan.importers.values import Where, as_bool, as_int, as_section, fail

_PREFIXES = ("lora_", "qlora_")
# torchtune's module names -> the Hugging Face ones zeroplan's targets use (MultiHeadAttention
# output_proj; FeedForward w1 gate, w3 up, w2 down; TransformerDecoder output)
_ATTENTION = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}
_MLP = ("gate_proj", "up_proj", "down_proj")
_ARGUMENTS = {"lora_attn_modules", "apply_lora_to_mlp", "apply_lora_to_output", "lora_rank", "lora_alpha",
              "lora_dropout", "use_dora", "quantize_base"}
RECIPE_KEYS = frozenset({"save_adapter_weights_only"})  # read by the LoRA recipes beyond the full-finetune keys


def base_builder(builder: str) -> str | None:
    """`torchtune.models.llama3.lora_llama3_8b` -> `torchtune.models.llama3.llama3_8b`; None for a full model."""
    module, _, name = builder.rpartition(".")
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return f"{module}.{name[len(prefix):]}"
    return None


def check_lora_model(model: Mapping[str, object], where: Where) -> None:
    """The builder's arguments, at load: lora_attn_modules is required, others must be the builder's."""
    arguments = {key for key in model if key != "_component_"}
    unknown = sorted(arguments - _ARGUMENTS)
    if unknown:
        raise fail(where, f"model.{unknown[0]}", "is not an argument of torchtune's LoRA model builders")
    if "lora_attn_modules" not in model:
        raise fail(where, "model.lora_attn_modules", "is missing (torchtune's LoRA model builders require it)")


def lora_settings(document: Mapping[str, object], where: Where) -> dict[str, object]:
    """{"lora": ..., "quant": ...} for a LoRA builder, {} for a full model."""
    model = as_section(document["model"], "model", where)
    builder = str(model.get("_component_"))
    if base_builder(builder) is None:
        return {}
    modules = model["lora_attn_modules"]
    if not isinstance(modules, list) or not modules or any(m not in _ATTENTION for m in modules):
        raise fail(where, "model.lora_attn_modules", f"must be a list of {', '.join(_ATTENTION)}, got {modules!r}")
    targets = [_ATTENTION[m] for m in modules]
    if as_bool(model.get("apply_lora_to_mlp", False), "model.apply_lora_to_mlp", where):
        targets += _MLP
    if as_bool(model.get("apply_lora_to_output", False), "model.apply_lora_to_output", where):
        targets.append("lm_head")
    dropout = model.get("lora_dropout", 0.0)
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool):
        raise fail(where, "model.lora_dropout", f"must be a number, got {dropout!r}")
    lora = {"rank": as_int(model.get("lora_rank", 8), "model.lora_rank", where, 1),
            "alpha": model.get("lora_alpha", 16), "targets": tuple(targets), "dropout": float(dropout),
            "dora": as_bool(model.get("use_dora", False), "model.use_dora", where)}
    settings: dict[str, object] = {"lora": lora}
    quantize = builder.rpartition(".")[2].startswith("qlora_") or as_bool(
        model.get("quantize_base", False), "model.quantize_base", where)
    if quantize:
        # torchtune modules/peft/lora.py LoRALinear(quantize_base=True): `to_nf4(weight)`, torchao's NF4Tensor (blocks
        # of 64, int8 scalers per 256 blocks), which FSDP2 shards scalers and all (estimate/adapters/lora.py)
        settings["quant"] = {"base_precision": "torchao-nf4", "compute_dtype": "bf16"}
    return settings

"""Read a Hugging Face `config.json` (already parsed into a dict) into a `TransformerSpec`.

Only data is read: nothing in the config is imported or executed (no `auto_map`, no
`trust_remote_code`). Each family maps its own keys, with the defaults its transformers
`models/<type>/configuration_<type>.py` gives a key that the file leaves out, and the bias and
tying choices its `modeling_<type>.py` hard-codes. The size keys (vocabulary, width, depth,
heads, MLP width) are required here even where transformers has a default: a config.json written
by transformers always carries them, and a silently defaulted width would be a wrong model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from zeroplan.errors import SpecError
from zeroplan.importers.hf_moe_config import MOE_FAMILIES, MoEConfigProblem
from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.validation import describe_validation_error, shown

_REQUIRED = object()


class _ConfigProblem(Exception):
    """Raised by the family readers; `spec_from_hf_config` adds the file name and re-raises."""


def _value(config: Mapping[str, Any], keys: tuple[str, ...], default: Any = _REQUIRED) -> Any:
    """The first of `keys` that the config sets to a non-null value, else `default`."""
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    if default is _REQUIRED:
        raise _ConfigProblem(f"no {keys[0]!r}, required for model_type {config.get('model_type')!r}")
    return default


def _rotary_gated(config: Mapping[str, Any], *, kv_heads: int | None, head_dim: int | None,
                  max_positions: int, tie: bool) -> dict[str, Any]:
    """Fields shared by the Llama-like families: RMSNorm, gated MLP, rotary, no positions."""
    return {
        "vocab_size": _value(config, ("vocab_size",)),
        "hidden_size": _value(config, ("hidden_size",)),
        "num_layers": _value(config, ("num_hidden_layers",)),
        "num_heads": _value(config, ("num_attention_heads",)),
        "num_kv_heads": _value(config, ("num_key_value_heads",), kv_heads),
        "head_dim": _value(config, ("head_dim",), head_dim),
        "intermediate_size": _value(config, ("intermediate_size",)),
        "max_position_embeddings": _value(config, ("max_position_embeddings",), max_positions),
        "position_embedding": "rotary",
        "norm": "rmsnorm",
        "mlp": "gated",
        "tie_word_embeddings": _value(config, ("tie_word_embeddings",), tie),
        # LlamaConfig (and Mistral, Mixtral, Qwen2, Gemma, Phi3): attention_dropout 0.0.
        "attention_dropout": _value(config, ("attention_dropout",), 0.0),
    }


def _llama(config: Mapping[str, Any]) -> dict[str, Any]:
    # LlamaConfig: max_position_embeddings 2048, untied; LlamaAttention puts `attention_bias` on
    # q, k, v and o_proj; LlamaMLP puts `mlp_bias` on all three projections.
    fields = _rotary_gated(config, kv_heads=None, head_dim=None, max_positions=2048, tie=False)
    bias = _value(config, ("attention_bias",), False)
    return fields | {"attention_bias": bias, "attention_out_bias": bias,
                     "mlp_bias": _value(config, ("mlp_bias",), False)}


def _mistral(config: Mapping[str, Any]) -> dict[str, Any]:
    # MistralConfig: num_key_value_heads 8, max_position_embeddings 4096 * 32, untied; no biases.
    return _rotary_gated(config, kv_heads=8, head_dim=None, max_positions=4096 * 32, tie=False)


def _mixtral(config: Mapping[str, Any]) -> dict[str, Any]:
    # MixtralConfig: as Mistral, plus num_local_experts 8 and num_experts_per_tok 2; the router
    # (MixtralTopKRouter) is a bias-free h x experts matrix.
    return _mistral(config) | {
        "num_experts": _value(config, ("num_local_experts",), 8),
        "experts_per_token": _value(config, ("num_experts_per_tok",), 2),
    }


def _qwen2(config: Mapping[str, Any]) -> dict[str, Any]:
    # Qwen2Config: num_key_value_heads 32, max_position_embeddings 32768, untied; Qwen2Attention
    # has bias=True on q, k, v and bias=False on o_proj.
    fields = _rotary_gated(config, kv_heads=32, head_dim=None, max_positions=32768, tie=False)
    return fields | {"attention_bias": True, "attention_out_bias": False}


def _gemma(config: Mapping[str, Any]) -> dict[str, Any]:
    # GemmaConfig: num_key_value_heads 16, head_dim 256 (not hidden/heads: 7B has 16 x 256 = 4096
    # query width on a 3072 model), max_position_embeddings 8192, tied; GemmaAttention puts
    # `attention_bias` on q, k, v and o_proj. GemmaRMSNorm holds one weight of size h.
    fields = _rotary_gated(config, kv_heads=16, head_dim=256, max_positions=8192, tie=True)
    bias = _value(config, ("attention_bias",), False)
    return fields | {"attention_bias": bias, "attention_out_bias": bias}


def _phi3(config: Mapping[str, Any]) -> dict[str, Any]:
    # Phi3Config: max_position_embeddings 4096, untied. Phi3Attention fuses q, k, v into one
    # bias-free qkv_proj of h x (q + 2 kv) and Phi3MLP fuses gate and up into gate_up_proj
    # (h x 2i): the same elements as separate projections. resid_pdrop 0.0 drives
    # resid_attn_dropout and resid_mlp_dropout; embd_pdrop is read by no module of Phi3Model.
    fields = _rotary_gated(config, kv_heads=None, head_dim=None, max_positions=4096, tie=False)
    return fields | {"residual_dropout": _value(config, ("resid_pdrop",), 0.0)}


def _qwen3(config: Mapping[str, Any]) -> dict[str, Any]:
    # Qwen3Config: num_key_value_heads 32, head_dim 128, max_position_embeddings 32768, untied;
    # Qwen3Attention puts `attention_bias` on q, k, v and o_proj and an RMSNorm of head_dim on q
    # and k (q_norm, k_norm). Its sliding window (use_sliding_window, off in every release) changes
    # no saved tensor under fused attention and is not read.
    fields = _rotary_gated(config, kv_heads=32, head_dim=128, max_positions=32768, tie=False)
    bias = _value(config, ("attention_bias",), False)
    return fields | {"attention_bias": bias, "attention_out_bias": bias, "qk_norm": "head"}


def _olmo2(config: Mapping[str, Any]) -> dict[str, Any]:
    # Olmo2Config: max_position_embeddings 2048, untied; Olmo2Attention puts `attention_bias` on q,
    # k, v and o_proj and one RMSNorm over the whole q and k projections; Olmo2DecoderLayer norms
    # the attention and MLP outputs only (post_attention_layernorm, post_feedforward_layernorm);
    # Olmo2RMSNorm multiplies the weight before casting back.
    fields = _rotary_gated(config, kv_heads=None, head_dim=None, max_positions=2048, tie=False)
    bias = _value(config, ("attention_bias",), False)
    return fields | {"attention_bias": bias, "attention_out_bias": bias, "qk_norm": "projection",
                     "norm_placement": "post", "norm_weight_in_fp32": True}


def _sliding_pattern(config: Mapping[str, Any], default: int) -> int:
    """Every Nth layer global: from `layer_types` when the config lists them, else
    `sliding_window_pattern` (Gemma 3's config.json), else the family's default."""
    layer_types = config.get("layer_types")
    if layer_types is None:
        return _value(config, ("sliding_window_pattern",), default)
    if not isinstance(layer_types, list) or not layer_types:
        raise _ConfigProblem("layer_types must be a list of 'sliding_attention' / 'full_attention'")
    full = [i + 1 for i, kind in enumerate(layer_types) if kind == "full_attention"]
    pattern = full[0] if full else len(layer_types) + 1
    expected = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(len(layer_types))]
    if layer_types != expected:
        raise _ConfigProblem("layer_types: only every Nth layer full (the others sliding) is supported")
    return pattern


def _gemma_sandwich(config: Mapping[str, Any], *, max_positions: int, pattern: int,
                    softcaps: tuple[float | None, float | None]) -> dict[str, Any]:
    """Gemma 2 and Gemma 3 text: four RMSNorms per block of (1 + w) in fp32, embeddings scaled by
    sqrt(hidden), tied, sliding-window layers every `pattern`th one global."""
    fields = _rotary_gated(config, kv_heads=4, head_dim=256, max_positions=max_positions, tie=True)
    bias = _value(config, ("attention_bias",), False)
    window = _value(config, ("sliding_window",), 4096)
    return fields | {
        "attention_bias": bias,
        "attention_out_bias": bias,
        "norm_placement": "sandwich",
        "norm_weight_in_fp32": True,
        "norm_unit_offset": True,
        "embedding_scale": True,
        "attention_softcap": _value(config, ("attn_logit_softcapping",), softcaps[0]),
        "final_logit_softcap": _value(config, ("final_logit_softcapping",), softcaps[1]),
        "sliding_window": window,
        "sliding_window_pattern": _sliding_pattern(config, pattern) if window else 1,
    }


def _gemma2(config: Mapping[str, Any]) -> dict[str, Any]:
    # Gemma2Config: num_key_value_heads 4, head_dim 256, max_position_embeddings 8192, tied,
    # sliding_window 4096 on every other layer (layer_types: (i + 1) % 2), attn_logit_softcapping
    # 50.0, final_logit_softcapping 30.0 (modeling_gemma2.py eager_attention_forward, Gemma2ForCausalLM).
    return _gemma_sandwich(config, max_positions=8192, pattern=2, softcaps=(50.0, 30.0))


def _gemma3_text(config: Mapping[str, Any]) -> dict[str, Any]:
    # Gemma3TextConfig: as Gemma 2, plus q_norm and k_norm of head_dim (Gemma3Attention), five
    # sliding layers to one global (sliding_window_pattern 6), no soft-capping by default.
    return _gemma_sandwich(config, max_positions=131_072, pattern=6, softcaps=(None, None)) | {
        "qk_norm": "head"}


def _gemma3(config: Mapping[str, Any]) -> dict[str, Any]:
    # Gemma3Config (image-text): the language model is text_config, a Gemma3TextConfig; the
    # vision tower and projector are not counted. The published 4B/12B/27B config.json files
    # leave vocab_size (and 4B the head counts) to Gemma3TextConfig's defaults (262,208; 8 and 4).
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise _ConfigProblem("no 'text_config', required for model_type 'gemma3' (its language model)")
    defaults = {"vocab_size": 262_208, "num_attention_heads": 8, "num_key_value_heads": 4}
    return _gemma3_text(defaults | {k: v for k, v in text.items() if v is not None}) | {
        "hf_model_type": "gemma3_text",
        "tie_word_embeddings": _value(text, ("tie_word_embeddings",), _value(config, ("tie_word_embeddings",), True))}


# SiglipVisionConfig's defaults (transformers models/siglip/configuration_siglip.py)
_SIGLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_channels": 3,
                    "image_size": 224, "patch_size": 16, "vision_use_head": True}


def vision_tower_params(config: Mapping[str, Any]) -> int:
    """Parameters of Gemma3ForConditionalGeneration's image side, which the estimate (its language model) leaves
    out: the SigLIP tower (transformers modeling_siglip.py SiglipVisionTransformer: the patch Conv2d with bias,
    a position embedding per patch, per layer two LayerNorms, q/k/v/out and fc1/fc2 Linears with biases, the
    post-LayerNorm; the attention-pooling head when vision_use_head) and Gemma3MultiModalProjector
    (mm_input_projection_weight, vision x text hidden, and the RMSNorm mm_soft_emb_norm)."""
    vision = _SIGLIP_DEFAULTS | {k: v for k, v in (config.get("vision_config") or {}).items() if v is not None}
    h, inner, layers = vision["hidden_size"], vision["intermediate_size"], vision["num_hidden_layers"]
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    embeddings = h * vision["num_channels"] * vision["patch_size"] ** 2 + h + patches * h
    layer = 4 * (h * h + h) + 2 * 2 * h + 2 * h * inner + inner + h
    head = (h + 3 * h * h + 3 * h + h * h + h + 2 * h + 2 * h * inner + inner + h) if vision["vision_use_head"] else 0
    text_hidden = (config.get("text_config") or {}).get("hidden_size", 2304)  # Gemma3TextConfig's default
    return embeddings + layers * layer + 2 * h + head + h * text_hidden + h


def _gpt2(config: Mapping[str, Any]) -> dict[str, Any]:
    # GPT2Config: n_positions 1024, n_inner None -> 4 * n_embd (GPT2Block), tied; its
    # attribute_map lets hidden_size etc. stand for n_embd etc. GPT2Attention's c_attn / c_proj
    # and GPT2MLP's c_fc / c_proj are Conv1D layers, all with bias; LayerNorms have bias.
    if config.get("add_cross_attention"):
        raise _ConfigProblem("add_cross_attention (GPT-2 with cross-attention) is not supported")
    hidden = _value(config, ("n_embd", "hidden_size"))
    return {
        "vocab_size": _value(config, ("vocab_size",)),
        "hidden_size": hidden,
        "num_layers": _value(config, ("n_layer", "num_hidden_layers")),
        "num_heads": _value(config, ("n_head", "num_attention_heads")),
        "intermediate_size": _value(config, ("n_inner",), 4 * hidden if isinstance(hidden, int) else hidden),
        "max_position_embeddings": _value(config, ("n_positions", "max_position_embeddings"), 1024),
        "position_embedding": "learned",
        "norm": "layernorm",
        "mlp": "gelu",
        "attention_bias": True,
        "attention_out_bias": True,
        "mlp_bias": True,
        "tie_word_embeddings": _value(config, ("tie_word_embeddings",), True),
        # GPT2Config: resid_pdrop, embd_pdrop and attn_pdrop 0.1 each.
        "embedding_dropout": _value(config, ("embd_pdrop",), 0.1),
        "attention_dropout": _value(config, ("attn_pdrop",), 0.1),
        "residual_dropout": _value(config, ("resid_pdrop",), 0.1),
    }


def _gpt_neox(config: Mapping[str, Any]) -> dict[str, Any]:
    # GPTNeoXConfig: max_position_embeddings 2048, untied (the head is a separate embed_out /
    # lm_head), attention_bias True on query_key_value and dense; GPTNeoXMLP's dense_h_to_4h and
    # dense_4h_to_h always have bias; LayerNorms have bias. Rotary (rotary_pct) has no parameters.
    bias = _value(config, ("attention_bias",), True)
    hidden_dropout = _value(config, ("hidden_dropout",), 0.0)  # GPTNeoXConfig: emb_dropout and the residual branches
    return {
        "vocab_size": _value(config, ("vocab_size",)),
        "hidden_size": _value(config, ("hidden_size",)),
        "num_layers": _value(config, ("num_hidden_layers",)),
        "num_heads": _value(config, ("num_attention_heads",)),
        "intermediate_size": _value(config, ("intermediate_size",)),
        "max_position_embeddings": _value(config, ("max_position_embeddings",), 2048),
        "position_embedding": "rotary",
        "norm": "layernorm",
        "mlp": "gelu",
        "attention_bias": bias,
        "attention_out_bias": bias,
        "mlp_bias": True,
        "tie_word_embeddings": _value(config, ("tie_word_embeddings",), False),
        "embedding_dropout": hidden_dropout,
        "attention_dropout": _value(config, ("attention_dropout",), 0.0),
        "residual_dropout": hidden_dropout,
    }


_FAMILIES: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "gemma3_text": _gemma3_text,
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "llama": _llama,
    "mistral": _mistral,
    "mixtral": _mixtral,
    "olmo2": _olmo2,
    "phi3": _phi3,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
} | {
    # Qwen3-MoE, DeepSeek-V3, GPT-OSS (importers/hf_moe_config.py): the Llama-like fields, then theirs
    model_type: (lambda config, defaults=defaults, read=read: read(config, _rotary_gated(config, tie=False, **defaults)))
    for model_type, (defaults, read) in MOE_FAMILIES.items()
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_FAMILIES))


def _nearest(model_type: Any) -> str:
    """", nearest: X" for a model_type close to a supported one (qwen3_next -> qwen3)."""
    if not isinstance(model_type, str):
        return ""
    import difflib  # only an unsupported model_type needs it

    close = difflib.get_close_matches(model_type.lower(), SUPPORTED_MODEL_TYPES, n=1, cutoff=0.6)
    return f" (nearest supported: {close[0]})" if close else ""


def is_hf_config(data: Mapping[str, Any]) -> bool:
    """A parsed JSON object is a Hugging Face config (not a zeroplan spec) if it has model_type."""
    return "model_type" in data


# Keys only a config.json written by transformers has (PretrainedConfig.to_dict), and the size keys the
# families read under transformers' names: a JSON object with them and no model_type is a config.json.
_HF_ONLY_KEYS = ("architectures", "transformers_version", "_name_or_path", "torch_dtype", "num_hidden_layers",
                 "num_attention_heads", "n_embd", "n_layer")


def looks_like_hf_config(data: Mapping[str, Any]) -> bool:
    """Whether a JSON object without model_type is still a Hugging Face config.json (one of _HF_ONLY_KEYS)."""
    return not is_hf_config(data) and any(key in data for key in _HF_ONLY_KEYS)


def missing_model_type(data: Mapping[str, Any]) -> str:
    """The one-line answer to a config.json without model_type: what is missing, what is read, a guess."""
    guess = ""
    architectures = data.get("architectures")
    if isinstance(architectures, list) and architectures and isinstance(architectures[0], str):
        # LlamaForCausalLM -> llama, GPT2LMHeadModel -> gpt2, Qwen3MoeForCausalLM -> qwen3_moe (longest name first)
        name = architectures[0].lower()
        for model_type in sorted(SUPPORTED_MODEL_TYPES, key=len, reverse=True):
            if name.startswith(model_type.replace("_", "")):
                guess = f"; for {architectures[0]} add \"model_type\": \"{model_type}\""
                break
    return (f"has no model_type, by which zeroplan reads a config.json (as transformers' AutoConfig does); "
            f"the families read are {', '.join(SUPPORTED_MODEL_TYPES)}{guess}")


# The type of every key the family readers take from a config.json, checked before they read it: transformers
# writes them as JSON numbers and booleans, and a "4096" or true where a width belongs is a broken file, not a
# value to convert (pydantic would take "4096" as 4096 and true as 1).
_FLOAT_KEYS = frozenset({"attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout",
                         "attn_logit_softcapping", "final_logit_softcapping"})
_BOOL_KEYS = frozenset({"tie_word_embeddings", "attention_bias", "mlp_bias", "add_cross_attention"})
_INT_KEYS = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "max_position_embeddings", "n_embd", "n_layer", "n_head", "n_inner", "n_positions",
    "sliding_window", "sliding_window_pattern", "num_local_experts", "num_experts", "num_experts_per_tok",
    "n_routed_experts", "moe_intermediate_size", "n_shared_experts", "decoder_sparse_step", "first_k_dense_replace",
    "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
})


def _check_types(config: Mapping[str, Any], prefix: str = "") -> None:
    """Every key the readers take has its JSON type (null: not set, as transformers writes a default)."""
    for key, value in config.items():
        if value is None:
            continue
        if key in _INT_KEYS:
            wanted, ok = "a whole number", type(value) is int
        elif key in _FLOAT_KEYS:
            wanted, ok = "a number", type(value) in (int, float)
        elif key in _BOOL_KEYS:
            wanted, ok = "true or false", type(value) is bool
        else:
            continue
        if not ok:
            kind = {str: "a string", bool: "a boolean", float: "a fraction", list: "a list", dict: "an object"}.get(
                type(value), type(value).__name__)
            raise _ConfigProblem(f"{prefix}{key} must be {wanted}, got {shown(value)} ({kind})")


def _notes(config: Mapping[str, Any]) -> tuple[str, ...]:
    """What a config.json holds that the spec does not model: said in the estimate, never dropped silently."""
    notes = []
    quantization = config.get("quantization_config")
    if isinstance(quantization, Mapping):
        from zeroplan.importers.hf_quant_config import checkpoint_quant_note  # issue 23: what the base is stored as

        notes.append(checkpoint_quant_note(config))
    elif quantization is not None:
        raise _ConfigProblem(f"quantization_config must be an object, got {shown(quantization)}")
    if config.get("model_type") == "gemma3" and config.get("vision_config") is not None:
        count = vision_tower_params(config)
        notes.append(f"gemma3: the language model (text_config) is counted; the vision tower (vision_config, SigLIP) "
                     f"and the multimodal projector, {count:,} parameters ({2 * count / 2**30:.2f} GiB in bf16), are not, "
                     "as in text-only training with them frozen and unused")
    return tuple(notes)


def spec_from_hf_config(config: Mapping[str, Any], name: str, source: str | None = None) -> TransformerSpec:
    """The `TransformerSpec` of a Hugging Face config.json, for the supported model types.

    `source` (the file or URL it came from) is recorded in the spec and names it in errors.
    """
    where = source or f"config.json of {name}"
    model_type = config.get("model_type")
    family = _FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise SpecError(
            f"{where}: model_type {model_type!r} is not supported{_nearest(model_type)}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    try:
        _check_types(config)
        if isinstance(config.get("text_config"), Mapping):
            _check_types(config["text_config"], "text_config.")
        # a family may name the model_type of the part it reads (gemma3: its gemma3_text language model)
        fields = {"hf_model_type": model_type} | family(config) | {"name": name, "source": source}
        notes = _notes(config)
        if notes:
            fields["notes"] = notes
    except (_ConfigProblem, MoEConfigProblem) as exc:
        raise SpecError(f"{where}: {exc}") from None
    try:
        return TransformerSpec.model_validate(fields)
    except ValidationError as exc:
        raise SpecError(_in_config_names(describe_validation_error(exc, where, TransformerSpec), config)) from None


# The config.json keys each spec field is read from (the families' `_value` calls), so that a field the spec
# refuses (num_layers past its bound) is named as the file names it (num_hidden_layers, or GPT-2's n_layer).
_FIELD_KEYS = {"num_layers": ("num_hidden_layers", "n_layer"), "num_heads": ("num_attention_heads", "n_head"),
               "hidden_size": ("n_embd", "hidden_size"), "num_kv_heads": ("num_key_value_heads",),
               "intermediate_size": ("n_inner", "intermediate_size"),
               "max_position_embeddings": ("n_positions", "max_position_embeddings"),
               "num_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
               "experts_per_token": ("num_experts_per_tok",)}


def _in_config_names(message: str, config: Mapping[str, Any]) -> str:
    """A TransformerSpec error with each field named by the key of `config` it came from."""
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else None
    for field, keys in _FIELD_KEYS.items():
        for source, prefix in ((config, ""), (text, "text_config.")):
            key = next((key for key in keys if source is not None and source.get(key) is not None), None)
            if key is not None:
                message = re.sub(rf"(^|: |; ){field}:", rf"\g<1>{prefix}{key}:", message)
                break
    return message

"""config.json readers for the mixture-of-experts families whose experts are narrower than the
dense MLP, and for multi-head latent attention: qwen3_moe, deepseek_v3, gpt_oss.

Defaults are those of transformers 5.23.0 models/<type>/configuration_<type>.py; the bias and
layer choices are those its modeling_<type>.py hard-codes. Registered in
`zeroplan.importers.hf_config` (`_FAMILIES`); errors are `MoEConfigProblem`, which it reports as its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class MoEConfigProblem(Exception):
    """A config.json these readers cannot take; `spec_from_hf_config` adds the file name."""


_problem = MoEConfigProblem


def _value(config: Mapping[str, Any], keys: tuple[str, ...], default: Any) -> Any:
    """The first of `keys` that the config sets to a non-null value, else `default`."""
    return next((config[key] for key in keys if config.get(key) is not None), default)


def _layer_count(config: Mapping[str, Any], key: str, count: int, layers: int) -> int:
    if not isinstance(count, int) or count < 0:
        raise _problem(f"{key} {count!r} is not a layer count")
    if count > layers:
        raise _problem(f"{key} {count} exceeds num_hidden_layers {layers}")
    return count


def _experts(config: Mapping[str, Any], experts_keys: tuple[str, ...], experts: int, top_k: int) -> dict[str, int]:
    """The routed expert count and top-k, checked against each other under the config's own names."""
    count, k = _value(config, experts_keys, experts), _value(config, ("num_experts_per_tok",), top_k)
    if isinstance(count, int) and isinstance(k, int) and k > count:
        raise _problem(f"num_experts_per_tok {k} exceeds {next((key for key in experts_keys if key in config), experts_keys[0])} {count}")
    return {"num_experts": count, "experts_per_token": k}


def _qwen3_moe(config: Mapping[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    # Qwen3MoeConfig: num_key_value_heads 4, max_position_embeddings 32768, untied. Qwen3MoeAttention
    # puts `attention_bias` on q, k, v and o_proj, and a q_norm and k_norm (RMSNorm over head_dim).
    # Qwen3MoeDecoderLayer: a Qwen3MoeSparseMoeBlock where layer_idx is not in mlp_only_layers and
    # (layer_idx + 1) % decoder_sparse_step == 0, else a dense Qwen3MoeMLP of intermediate_size.
    layers = fields["num_layers"]
    step = _value(config, ("decoder_sparse_step",), 1)
    if not isinstance(step, int) or step < 1:
        raise _problem(f"decoder_sparse_step {step!r} is not a positive layer step")
    only = _value(config, ("mlp_only_layers",), [])
    beyond = [i for i in only if not isinstance(i, int) or not 0 <= i < layers]
    if beyond:
        raise _problem(f"mlp_only_layers: layer {beyond[0]!r} is not one of the {layers} layers (num_hidden_layers)")
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    bias = _value(config, ("attention_bias",), False)
    return fields | {
        "attention_bias": bias,
        "attention_out_bias": bias,
        "moe": {
            **_experts(config, ("num_experts", "num_local_experts"), 128, 8),
            "expert_intermediate_size": _value(config, ("moe_intermediate_size",), 768),
            "dense_layers": dense,
            "router": "softmax-topk",
        },
    }


def _deepseek_v3(config: Mapping[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    # DeepseekV3Config: num_key_value_heads = num_attention_heads when null, max_position_embeddings
    # 4096, untied, head_dim = qk_rope_head_dim. DeepseekV3Attention puts `attention_bias` on
    # q_a_proj, kv_a_proj_with_mqa and o_proj. DeepseekV3DecoderLayer: a dense DeepseekV3MLP in the
    # first `first_k_dense_replace` layers, a DeepseekV3MoE (routed experts, a sigmoid router, one
    # shared MLP of moe_intermediate_size x n_shared_experts) after. num_nextn_predict_layers: the
    # multi-token-prediction layers of DeepSeek's checkpoint, which transformers skips on load
    # (DeepseekV3PreTrainedModel._keys_to_ignore_on_load_unexpected): not built here either.
    rope = _value(config, ("qk_rope_head_dim",), 64)
    fields = fields | {"head_dim": rope}
    layers = fields["num_layers"]
    first_dense = _layer_count(config, "first_k_dense_replace", _value(config, ("first_k_dense_replace",), 3), layers)
    bias = _value(config, ("attention_bias",), False)
    return fields | {
        "attention_bias": bias,
        "attention_out_bias": bias,
        "moe": {
            **_experts(config, ("n_routed_experts", "num_local_experts"), 256, 8),
            "expert_intermediate_size": _value(config, ("moe_intermediate_size",), 2048),
            "shared_expert_intermediate_size": _value(config, ("moe_intermediate_size",), 2048)
            * _value(config, ("n_shared_experts",), 1),
            "dense_layers": tuple(range(first_dense)),
            "router": "sigmoid-grouped",
        },
        "mla": {
            "q_lora_rank": _value(config, ("q_lora_rank",), None) if "q_lora_rank" in config else 1536,
            "kv_lora_rank": _value(config, ("kv_lora_rank",), 512),
            "qk_rope_head_dim": rope,
            "qk_nope_head_dim": _value(config, ("qk_nope_head_dim",), 128),
            "v_head_dim": _value(config, ("v_head_dim",), 128),
        },
    }


def _gpt_oss(config: Mapping[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    # GptOssConfig: head_dim 64, num_key_value_heads 8, max_position_embeddings 131072, untied,
    # attention_bias True (q, k, v and o_proj). GptOssAttention: a sink logit per head; its
    # layer_types alternate sliding (window `sliding_window`) and full attention, which changes
    # masks, not tensor sizes (docs/engines/moe.md). GptOssMLP: a router with a bias and
    # num_local_experts experts of intermediate_size with biases, in every layer.
    bias = _value(config, ("attention_bias",), True)
    return fields | {
        "attention_bias": bias,
        "attention_out_bias": bias,
        "attention_sinks": True,
        "moe": {
            **_experts(config, ("num_local_experts", "num_experts"), 128, 4),
            "expert_intermediate_size": fields["intermediate_size"],
            "router": "topk-softmax",
            "router_bias": True,
            "expert_bias": True,
        },
    }


# model_type: (the Llama-like fields' defaults, the reader of the rest). DeepSeek's kv heads
# default to the query heads (DeepseekV3Config.__post_init__): None here, read by the caller as such.
MOE_FAMILIES = {
    "deepseek_v3": ({"kv_heads": None, "head_dim": None, "max_positions": 4096}, _deepseek_v3),
    "gpt_oss": ({"kv_heads": 8, "head_dim": 64, "max_positions": 131072}, _gpt_oss),
    "qwen3_moe": ({"kv_heads": 4, "head_dim": None, "max_positions": 32768}, _qwen3_moe),
}

"""The transformers config fields of the Qwen3-MoE, DeepSeek-V3 and GPT-OSS specs
(measure/workload.py `hf_config_kwargs` hands these families here). No torch."""

from __future__ import annotations

from typing import Any

from zeroplan.errors import MeasureError
from zeroplan.spec.model import TransformerSpec


def moe_config_kwargs(spec: TransformerSpec, rotary: dict[str, Any]) -> dict[str, Any]:
    """`rotary`: the Llama-like fields workload.py gives every rotary family."""
    moe, mla = spec.moe, spec.mla
    experts = {"num_experts_per_tok": moe.experts_per_token, "moe_intermediate_size": moe.expert_intermediate_size}
    if spec.model_type == "qwen3_moe":
        return rotary | experts | {
            "num_experts": moe.num_experts, "decoder_sparse_step": 1, "mlp_only_layers": list(moe.dense_layers),
            "norm_topk_prob": True, "attention_bias": spec.attention_bias, "use_sliding_window": False,
        }
    if spec.model_type == "deepseek_v3":
        first_dense = len(moe.dense_layers)
        if moe.dense_layers != tuple(range(first_dense)):
            raise MeasureError(f"moe.dense_layers {list(moe.dense_layers)}: DeepSeek-V3 has its dense layers first "
                               "(first_k_dense_replace)")
        shared, rest = divmod(moe.shared_expert_intermediate_size, moe.expert_intermediate_size)
        if rest:
            raise MeasureError("moe.shared_expert_intermediate_size: DeepSeek-V3 builds shared experts as "
                               "n_shared_experts x moe_intermediate_size")
        # One router group: the group top-k only picks indices (nothing of it is kept for backward).
        return {k: v for k, v in rotary.items() if k != "head_dim"} | experts | {
            "n_routed_experts": moe.num_experts, "n_shared_experts": shared, "first_k_dense_replace": first_dense,
            "n_group": 1, "topk_group": 1, "q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank,
            "qk_rope_head_dim": mla.qk_rope_head_dim, "qk_nope_head_dim": mla.qk_nope_head_dim,
            "v_head_dim": mla.v_head_dim, "attention_bias": spec.attention_bias,
        }
    if spec.model_type == "gpt_oss":
        return rotary | {"num_local_experts": moe.num_experts, "num_experts_per_tok": moe.experts_per_token,
                         "attention_bias": spec.attention_bias}
    raise MeasureError(f"model: hf_model_type {spec.model_type!r} has no Hugging Face mapping here")

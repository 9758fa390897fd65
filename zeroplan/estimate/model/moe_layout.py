"""Parameter tensors of the mixture-of-experts and latent-attention families: Qwen3-MoE,
DeepSeek-V3 and GPT-OSS, tensor by tensor in `model.parameters()` order (a module's own
parameters before its children's), as transformers 5.23.0 builds them.

Their blocks are not all alike: DeepSeek-V3's first `first_k_dense_replace` layers and
Qwen3-MoE's `mlp_only_layers` have a dense MLP. The blocks come as runs of one kind in forward
order (`ParamLayout.block_runs`), so that ZeRO-3 and FSDP2 gather, shard and keep whole (the
persistence threshold) each kind's own tensors. Routed experts are fused 3-D tensors whose dim 0
is the expert count: what FSDP2 shards and pads (docs/engines/moe.md).
"""

from __future__ import annotations

from typing import NamedTuple

from zeroplan.spec.model import TransformerSpec


class Tensor(NamedTuple):
    """A parameter tensor as `zeroplan.estimate.model.layout.ParamTensor` holds it (that module builds
    its layout from these: it imports this one, not the other way)."""

    name: str
    numel: int
    rows: int  # dim 0


class MoELayout(NamedTuple):
    embedding: tuple[Tensor, ...]
    runs: tuple[tuple[tuple[Tensor, ...], int], ...]  # (one block's tensors, consecutive blocks) in forward order
    final: tuple[Tensor, ...]


def _linear(name: str, in_features: int, out_features: int, bias: bool) -> list[Tensor]:
    # nn.Linear stores weight as (out, in): dim 0 is the output width.
    tensors = [Tensor(f"{name}.weight", in_features * out_features, out_features)]
    if bias:
        tensors.append(Tensor(f"{name}.bias", out_features, out_features))
    return tensors


def _norm(name: str, spec: TransformerSpec) -> list[Tensor]:
    return [Tensor(f"{name}.weight", spec.hidden_size, spec.hidden_size)]  # RMSNorm in all three families


def _rms(name: str, width: int) -> list[Tensor]:
    return [Tensor(f"{name}.weight", width, width)]


def _attention(spec: TransformerSpec) -> list[Tensor]:
    h, heads = spec.hidden_size, spec.num_heads
    bias, out_bias = spec.attention_bias, spec.attention_out_bias
    mla = spec.mla
    if mla is not None:
        # DeepseekV3Attention.__init__: q_proj or (q_a_proj, q_a_layernorm, q_b_proj),
        # kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; attention_bias on the a-projections and o_proj.
        q_width = heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            query = _linear("attn.q_proj", h, q_width, False)
        else:
            query = (_linear("attn.q_a_proj", h, mla.q_lora_rank, bias) + _rms("attn.q_a_layernorm", mla.q_lora_rank)
                     + _linear("attn.q_b_proj", mla.q_lora_rank, q_width, False))
        return (query
                + _linear("attn.kv_a_proj_with_mqa", h, mla.kv_lora_rank + mla.qk_rope_head_dim, bias)
                + _rms("attn.kv_a_layernorm", mla.kv_lora_rank)
                + _linear("attn.kv_b_proj", mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), False)
                + _linear("attn.o_proj", heads * mla.v_head_dim, h, out_bias))
    q_width = heads * spec.dim_per_head
    kv_width = spec.kv_heads * spec.dim_per_head
    # GptOssAttention: its own `sinks` (one logit per head) comes before its child projections.
    sinks = [Tensor("attn.sinks", heads, heads)] if spec.attention_sinks else []
    projections = (_linear("attn.q_proj", h, q_width, bias) + _linear("attn.k_proj", h, kv_width, bias)
                   + _linear("attn.v_proj", h, kv_width, bias) + _linear("attn.o_proj", q_width, h, out_bias))
    # Qwen3MoeAttention: q_norm and k_norm, RMSNorms over head_dim, after o_proj.
    qk_norms = _rms("attn.q_norm", spec.dim_per_head) + _rms("attn.k_norm", spec.dim_per_head) \
        if spec.hf_model_type == "qwen3_moe" else []
    return sinks + projections + qk_norms


def _gated_mlp(prefix: str, h: int, inner: int) -> list[Tensor]:
    # Qwen3MoeMLP / DeepseekV3MLP: gate_proj, up_proj (h -> i), down_proj (i -> h), bias-free.
    return (_linear(f"{prefix}.gate_proj", h, inner, False) + _linear(f"{prefix}.up_proj", h, inner, False)
            + _linear(f"{prefix}.down_proj", inner, h, False))


def _sparse_mlp(spec: TransformerSpec) -> list[Tensor]:
    moe, h = spec.moe, spec.hidden_size
    experts, inner = moe.num_experts, moe.expert_intermediate_size
    # Every family's experts: gate_up_proj (E, 2i, h) and down_proj (E, h, i); GPT-OSS stores them
    # transposed, (E, h, 2i) and (E, i, h): the same elements, dim 0 the expert count either way.
    stacked = [Tensor("moe.experts.gate_up_proj", experts * 2 * inner * h, experts)]
    if moe.expert_bias:
        stacked.append(Tensor("moe.experts.gate_up_proj_bias", experts * 2 * inner, experts))
    stacked.append(Tensor("moe.experts.down_proj", experts * inner * h, experts))
    if moe.expert_bias:
        stacked.append(Tensor("moe.experts.down_proj_bias", experts * h, experts))
    router = [Tensor("moe.gate.weight", experts * h, experts)]
    if moe.router_bias:
        router.append(Tensor("moe.gate.bias", experts, experts))
    if spec.hf_model_type == "gpt_oss":
        # GptOssMLP.__init__: router, then experts.
        return router + stacked
    # Qwen3MoeSparseMoeBlock / DeepseekV3MoE: experts, gate (DeepSeek's e_score_correction_bias is
    # a buffer, not a parameter), then DeepSeek's shared_experts.
    shared = _gated_mlp("moe.shared_experts", h, moe.shared_expert_intermediate_size) \
        if moe.shared_expert_intermediate_size else []
    return stacked + router + shared


def _block(spec: TransformerSpec, sparse: bool) -> tuple[Tensor, ...]:
    # Qwen3MoeDecoderLayer / DeepseekV3DecoderLayer / GptOssDecoderLayer: self_attn, mlp,
    # input_layernorm, post_attention_layernorm.
    mlp = _sparse_mlp(spec) if sparse else _gated_mlp("mlp", spec.hidden_size, spec.intermediate_size)
    return tuple(_attention(spec) + mlp + _norm("attn_norm", spec) + _norm("mlp_norm", spec))


def _mtp_layer(spec: TransformerSpec) -> tuple[Tensor, ...]:
    """One multi-token-prediction module of DeepSeek-V3 (its paper, section 2.2; DeepSeek's
    inference/model.py checkpoint layout): enorm and hnorm, eh_proj (2h -> h), a sparse decoder
    layer and the shared head's norm; the embedding and the output head are the main model's."""
    h = spec.hidden_size
    return (tuple(_rms("mtp.enorm", h) + _rms("mtp.hnorm", h) + _linear("mtp.eh_proj", 2 * h, h, False))
            + _block(spec, True) + tuple(_rms("mtp.shared_head.norm", h)))


def moe_param_layout(spec: TransformerSpec) -> MoELayout:
    """The tensors of a spec with `moe`, `mla` or attention sinks: blocks as runs of one kind."""
    sparse = [spec.moe is not None and spec.moe.sparse(i) for i in range(spec.num_layers)]
    kinds = {flag: _block(spec, flag) for flag in set(sparse)}
    runs: list[tuple[tuple[Tensor, ...], int]] = []
    for flag in sparse:
        if runs and runs[-1][0] is kinds[flag]:
            runs[-1] = (kinds[flag], runs[-1][1] + 1)
        else:
            runs.append((kinds[flag], 1))
    if spec.moe is not None and spec.moe.mtp_layers:
        runs.append((_mtp_layer(spec), spec.moe.mtp_layers))
    h = spec.hidden_size
    embedding = (Tensor("embed_tokens.weight", spec.vocab_size * h, spec.vocab_size),)
    final = _norm("final_norm", spec)
    if not spec.tie_word_embeddings:
        final += _linear("lm_head", h, spec.vocab_size, bias=False)
    return MoELayout(embedding, tuple(runs), tuple(final))

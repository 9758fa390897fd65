"""The parameter tensors a `TransformerSpec` instantiates, tensor by tensor.

Counting tensor by tensor (not with a closed formula) matters for ZeRO: DeepSpeed ZeRO-3 keeps
every tensor under `stage3_param_persistence_threshold` elements whole on every rank, FSDP2 shards
each tensor on dim 0 with padding, and both gather one module at a time. The shapes follow the
Hugging Face implementations named in each branch (transformers/models/<type>/modeling_<type>.py);
`tests/estimate/model/test_param_counts.py` checks the totals against published counts and, where transformers is
installed, against the model it builds on the meta device.
"""

from __future__ import annotations

from typing import NamedTuple


from zeroplan.estimate.model.moe_layout import moe_param_layout
from zeroplan.spec.model import TransformerSpec


class ParamTensor(NamedTuple):
    """One parameter tensor: its name inside its module group, and its element count."""

    name: str
    numel: int
    rows: int  # size of dim 0: FSDP2 shards on dim 0 and pads it to a multiple of the world size
    frozen: bool = False  # a frozen tensor in a group that trains (LoRA's base weights beside its adapters)
    # bytes per element where the module keeps a dtype of its own that an engine which does not cast honours (a
    # modules_to_save copy, in the base's dtype: estimate/adapters/lora.py `saved_copy_element`); 0: the engine's
    element: int = 0
    role: str = ""  # its layer's part in the model (`ROLES`), set once by the layout: what the mesh and adapters read


ROLES = ("embedding", "positions", "qkv_in", "attn_out", "mlp_in", "mlp_out", "router", "experts", "norm", "head",
         "sinks", "latent_proj", "mtp_proj", "layer")
"""Layer roles: the token embedding and learned positions, attention's input projections (q, k, v, fused qkv) and
output projection, the MLP's input (gate, up, fused, fc_in) and output (down, fc_out) projections, a MoE's router
and fused routed experts, norms, the output head, attention sinks, multi-head latent attention's low-rank
projections, DeepSeek's multi-token-prediction projection, a count-only model's layers. A LoRA adapter has the role
of the layer it adapts (estimate/adapters/lora.py)."""

# The layout's own module names (one naming for every family, below) and their roles; the family's
# transformers names map to these in estimate/adapters/lora.py (PEFT matches those).
_ROLE_OF_LAYER = {
    "embed_tokens": "embedding", "embed_positions": "positions", "lm_head": "head", "sinks": "sinks",
    "q_proj": "qkv_in", "k_proj": "qkv_in", "v_proj": "qkv_in", "qkv_proj": "qkv_in", "c_attn": "qkv_in",
    "o_proj": "attn_out", "gate_proj": "mlp_in", "up_proj": "mlp_in", "gate_up_proj": "mlp_in", "c_fc": "mlp_in",
    "fc_in": "mlp_in", "down_proj": "mlp_out", "fc_out": "mlp_out", "gate": "router", "experts": "experts",
    "q_a_proj": "latent_proj", "q_b_proj": "latent_proj", "kv_a_proj_with_mqa": "latent_proj", "kv_b_proj": "latent_proj",
    "eh_proj": "mtp_proj", "layer": "layer",
}


def role_of(name: str) -> str:
    """The role of the layout tensor `name` (`ROLES`): its layer's, GPT-2's c_proj by the branch it ends."""
    parts = name.split(".")
    if "experts" in parts[:-1]:  # the fused routed experts (not shared_experts, a dense MLP)
        return "experts"
    if any("norm" in part for part in parts[:-1]):
        return "norm"
    layer = parts[-2] if len(parts) > 1 else parts[0]  # the module of a .weight / .bias, or a bare module name
    if layer == "c_proj":
        return "attn_out" if parts[0] == "attn" else "mlp_out"
    return _ROLE_OF_LAYER.get(layer, _ROLE_OF_LAYER.get(parts[-1], ""))


def with_roles(tensors) -> tuple[ParamTensor, ...]:
    return tuple([t._replace(role=role_of(t.name)) for t in tensors])


class ParamLayout(NamedTuple):
    """A transformer's parameters grouped the way ZeRO-3 and FSDP2 gather them: per module group."""

    embedding: tuple[ParamTensor, ...]  # token embedding, and learned positions where present
    block: tuple[ParamTensor, ...]  # one transformer block; every block is identical
    num_blocks: int
    final: tuple[ParamTensor, ...]  # final norm and, when untied, the output head
    # Blocks of more than one kind (dense and sparse MLPs: estimate/model/moe_layout.py), as runs of
    # (tensors, count) in forward order; `block` is then the largest kind. Empty: `block` x num_blocks.
    block_runs: tuple[tuple[tuple[ParamTensor, ...], int], ...] = ()

    @property
    def runs(self) -> tuple[tuple[tuple[ParamTensor, ...], int], ...]:
        return self.block_runs or ((self.block, self.num_blocks),)

    @property
    def embedding_params(self) -> int:
        return sum(t.numel for t in self.embedding)

    @property
    def block_params(self) -> int:
        return sum(t.numel for t in self.block)

    @property
    def final_params(self) -> int:
        return sum(t.numel for t in self.final)

    @property
    def total_params(self) -> int:
        blocks = sum(count * sum(t.numel for t in tensors) for tensors, count in self.runs)
        return self.embedding_params + blocks + self.final_params

    @property
    def all_tensors(self) -> tuple[ParamTensor, ...]:
        return self.embedding + sum((tensors * count for tensors, count in self.runs), ()) + self.final


def _linear(name: str, in_features: int, out_features: int, bias: bool) -> list[ParamTensor]:
    # nn.Linear stores weight as (out, in): dim 0 is the output width.
    tensors = [ParamTensor(f"{name}.weight", in_features * out_features, out_features)]
    if bias:
        tensors.append(ParamTensor(f"{name}.bias", out_features, out_features))
    return tensors


def _conv1d(name: str, in_features: int, out_features: int) -> list[ParamTensor]:
    # GPT-2's Conv1D (transformers/pytorch_utils.py) stores weight as (in, out): dim 0 is the input.
    return [
        ParamTensor(f"{name}.weight", in_features * out_features, in_features),
        ParamTensor(f"{name}.bias", out_features, out_features),
    ]


def _norm(name: str, spec: TransformerSpec) -> list[ParamTensor]:
    # LayerNorm: weight and bias; RMSNorm (Llama, Gemma): weight only.
    tensors = [ParamTensor(f"{name}.weight", spec.hidden_size, spec.hidden_size)]
    if spec.norm == "layernorm":
        tensors.append(ParamTensor(f"{name}.bias", spec.hidden_size, spec.hidden_size))
    return tensors


def _attention(spec: TransformerSpec) -> list[ParamTensor]:
    h = spec.hidden_size
    q_width = spec.num_heads * spec.dim_per_head
    kv_width = spec.kv_heads * spec.dim_per_head
    qkv_width = q_width + 2 * kv_width
    if spec.hf_model_type == "gpt2":
        # GPT2Attention: c_attn (h, 3h) and c_proj (h, h), both Conv1D with bias.
        return _conv1d("attn.c_attn", h, qkv_width) + _conv1d("attn.c_proj", q_width, h)
    if spec.hf_model_type == "gpt_neox":
        # GPTNeoXAttention: query_key_value (one fused projection), then dense.
        return _linear("attn.qkv_proj", h, qkv_width, spec.attention_bias) + _linear(
            "attn.o_proj", q_width, h, spec.attention_out_bias
        )
    if spec.hf_model_type == "phi3":
        # Phi3Attention.__init__ registers o_proj before the fused qkv_proj.
        return _linear("attn.o_proj", q_width, h, spec.attention_out_bias) + _linear(
            "attn.qkv_proj", h, qkv_width, spec.attention_bias
        )
    # LlamaAttention (and Mistral, Mixtral, Qwen2, Gemma): separate q, k, v and o projections.
    return (
        _linear("attn.q_proj", h, q_width, spec.attention_bias)
        + _linear("attn.k_proj", h, kv_width, spec.attention_bias)
        + _linear("attn.v_proj", h, kv_width, spec.attention_bias)
        + _linear("attn.o_proj", q_width, h, spec.attention_out_bias)
        + _qk_norms(spec)
    )


def _qk_norms(spec: TransformerSpec) -> list[ParamTensor]:
    # Qwen3Attention / Gemma3Attention register q_norm and k_norm (head_dim each) after o_proj;
    # Olmo2Attention's span the whole projections (num_heads x head_dim, num_kv_heads x head_dim).
    if spec.qk_norm == "none":
        return []
    q_width, kv_width = (spec.dim_per_head,) * 2 if spec.qk_norm == "head" else (
        spec.num_heads * spec.dim_per_head, spec.kv_heads * spec.dim_per_head)
    return [ParamTensor("attn.q_norm.weight", q_width, q_width), ParamTensor("attn.k_norm.weight", kv_width, kv_width)]


def _mlp(prefix: str, spec: TransformerSpec) -> list[ParamTensor]:
    h, inner = spec.hidden_size, spec.intermediate_size
    if spec.hf_model_type == "gpt2":
        # GPT2MLP: c_fc (h, i) and c_proj (i, h), Conv1D with bias.
        return _conv1d(f"{prefix}.c_fc", h, inner) + _conv1d(f"{prefix}.c_proj", inner, h)
    if spec.hf_model_type == "phi3":
        # Phi3MLP: gate_up_proj (2i, h) fused, down_proj (h, i).
        return _linear(f"{prefix}.gate_up_proj", h, 2 * inner, spec.mlp_bias) + _linear(
            f"{prefix}.down_proj", inner, h, spec.mlp_bias
        )
    if spec.mlp == "gated":
        # LlamaMLP: gate_proj and up_proj (h -> i), down_proj (i -> h).
        return (
            _linear(f"{prefix}.gate_proj", h, inner, spec.mlp_bias)
            + _linear(f"{prefix}.up_proj", h, inner, spec.mlp_bias)
            + _linear(f"{prefix}.down_proj", inner, h, spec.mlp_bias)
        )
    # GPTNeoXMLP: dense_h_to_4h and dense_4h_to_h.
    return _linear(f"{prefix}.fc_in", h, inner, spec.mlp_bias) + _linear(f"{prefix}.fc_out", inner, h, spec.mlp_bias)


def _experts(spec: TransformerSpec) -> list[ParamTensor]:
    h, inner, experts = spec.hidden_size, spec.intermediate_size, spec.num_experts
    # MixtralSparseMoeBlock (transformers 5): a bias-free router `gate` (E, h) and the experts
    # stored as two 3-D tensors, gate_up_proj (E, 2i, h) and down_proj (E, h, i).
    return [
        ParamTensor("moe.gate.weight", experts * h, experts),
        ParamTensor("moe.experts.gate_up_proj", experts * 2 * inner * h, experts),
        ParamTensor("moe.experts.down_proj", experts * h * inner, experts),
    ]


def _block(spec: TransformerSpec) -> list[ParamTensor]:
    """One block's tensors in the order its module registers them (`model.parameters()` order,
    which DeepSpeed flattens and partitions by)."""
    mlp = _experts(spec) if spec.is_moe else _mlp("mlp", spec)
    if spec.hf_model_type == "gpt2":
        # GPT2Block.__init__: ln_1, attn, ln_2, mlp.
        return _norm("attn_norm", spec) + _attention(spec) + _norm("mlp_norm", spec) + mlp
    norms = _norm("attn_norm", spec) + _norm("mlp_norm", spec)
    if spec.hf_model_type == "gpt_neox":
        # GPTNeoXLayer.__init__: input_layernorm, post_attention_layernorm, attention, mlp.
        return norms + _attention(spec) + mlp
    if spec.norm_placement == "sandwich":
        # Gemma2DecoderLayer / Gemma3DecoderLayer: input_layernorm, post_attention_layernorm,
        # pre_feedforward_layernorm, post_feedforward_layernorm, after self_attn and mlp.
        norms = (_norm("attn_norm", spec) + _norm("attn_out_norm", spec) + _norm("mlp_norm", spec)
                 + _norm("mlp_out_norm", spec))
    elif spec.norm_placement == "post":
        # Olmo2DecoderLayer: post_attention_layernorm and post_feedforward_layernorm only.
        norms = _norm("attn_out_norm", spec) + _norm("mlp_out_norm", spec)
    # LlamaDecoderLayer (and Mistral, Mixtral, Qwen2, Qwen3, Gemma, Phi-3): self_attn, mlp, then
    # input_layernorm and post_attention_layernorm.
    return _attention(spec) + mlp + norms


def param_layout(spec: TransformerSpec) -> ParamLayout:
    """Every parameter tensor of `spec`, grouped into embedding, one block, and final modules."""
    if spec.moe is not None or spec.mla is not None or spec.attention_sinks:
        return _moe_layout(spec)
    h = spec.hidden_size
    embedding = [ParamTensor("embed_tokens.weight", spec.vocab_size * h, spec.vocab_size)]
    if spec.position_embedding == "learned":
        # GPT-2's wpe: one row per position up to n_positions.
        embedding.append(ParamTensor("embed_positions.weight", spec.max_position_embeddings * h, spec.max_position_embeddings))
    final = _norm("final_norm", spec)
    if not spec.tie_word_embeddings:
        final += _linear("lm_head", h, spec.vocab_size, bias=False)
    return ParamLayout(with_roles(embedding), with_roles(_block(spec)), spec.num_layers, with_roles(final))


def _moe_layout(spec: TransformerSpec) -> ParamLayout:
    """Qwen3-MoE, DeepSeek-V3, GPT-OSS (estimate/model/moe_layout.py): `block` is the largest kind."""
    moe = moe_param_layout(spec)
    runs = tuple((with_roles(ParamTensor(*t) for t in tensors), count) for tensors, count in moe.runs)
    largest = max((tensors for tensors, _ in runs), key=lambda tensors: sum(t.numel for t in tensors))
    return ParamLayout(with_roles(ParamTensor(*t) for t in moe.embedding), largest, sum(count for _, count in runs),
                       with_roles(ParamTensor(*t) for t in moe.final), runs)

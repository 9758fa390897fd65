"""The parameter tensors a `TransformerSpec` instantiates, tensor by tensor.

Counting tensor by tensor (not with a closed formula) matters for ZeRO: DeepSpeed ZeRO-3 keeps
every tensor under `stage3_param_persistence_threshold` elements whole on every rank, FSDP2 shards
each tensor on dim 0 with padding, and both gather one module at a time. The shapes follow the
Hugging Face implementations named in each branch (transformers/models/<type>/modeling_<type>.py);
`tests/test_param_counts.py` checks the totals against published counts and, where transformers is
installed, against the model it builds on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.spec.model import TransformerSpec


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor: its name inside its module group, and its element count."""

    name: str
    numel: int
    rows: int  # size of dim 0: FSDP2 shards on dim 0 and pads it to a multiple of the world size


@dataclass(frozen=True)
class ParamLayout:
    """A transformer's parameters grouped the way ZeRO-3 and FSDP2 gather them: per module group."""

    embedding: tuple[ParamTensor, ...]  # token embedding, and learned positions where present
    block: tuple[ParamTensor, ...]  # one transformer block; every block is identical
    num_blocks: int
    final: tuple[ParamTensor, ...]  # final norm and, when untied, the output head

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
        return self.embedding_params + self.num_blocks * self.block_params + self.final_params

    @property
    def all_tensors(self) -> tuple[ParamTensor, ...]:
        return self.embedding + self.block * self.num_blocks + self.final


def _linear(name: str, in_features: int, out_features: int, bias: bool) -> list[ParamTensor]:
    # nn.Linear stores weight as (out, in); GPT-2's Conv1D stores (in, out), same count.
    tensors = [ParamTensor(f"{name}.weight", in_features * out_features, out_features)]
    if bias:
        tensors.append(ParamTensor(f"{name}.bias", out_features, out_features))
    return tensors


def _norm(name: str, spec: TransformerSpec) -> list[ParamTensor]:
    # LayerNorm: weight and bias; RMSNorm (Llama, Gemma): weight only.
    tensors = [ParamTensor(f"{name}.weight", spec.hidden_size, spec.hidden_size)]
    if spec.norm == "layernorm":
        tensors.append(ParamTensor(f"{name}.bias", spec.hidden_size, spec.hidden_size))
    return tensors


def _mlp(prefix: str, spec: TransformerSpec) -> list[ParamTensor]:
    h, inner = spec.hidden_size, spec.intermediate_size
    if spec.mlp == "gated":
        # LlamaMLP: gate_proj and up_proj (h -> i), down_proj (i -> h).
        return (
            _linear(f"{prefix}.gate_proj", h, inner, spec.mlp_bias)
            + _linear(f"{prefix}.up_proj", h, inner, spec.mlp_bias)
            + _linear(f"{prefix}.down_proj", inner, h, spec.mlp_bias)
        )
    # GPT2MLP: c_fc (h -> i), c_proj (i -> h), both with bias when mlp_bias.
    return _linear(f"{prefix}.fc_in", h, inner, spec.mlp_bias) + _linear(f"{prefix}.fc_out", inner, h, spec.mlp_bias)


def _block(spec: TransformerSpec) -> list[ParamTensor]:
    h = spec.hidden_size
    q_width = spec.num_heads * spec.dim_per_head
    kv_width = spec.kv_heads * spec.dim_per_head
    tensors = _norm("attn_norm", spec)
    # Separate q, k, v projections (Llama); GPT-2's fused c_attn and Phi-3's qkv_proj hold the
    # same elements: h x (q + 2 kv) plus the same bias.
    tensors += _linear("attn.q_proj", h, q_width, spec.attention_bias)
    tensors += _linear("attn.k_proj", h, kv_width, spec.attention_bias)
    tensors += _linear("attn.v_proj", h, kv_width, spec.attention_bias)
    tensors += _linear("attn.o_proj", q_width, h, spec.attention_out_bias)
    tensors += _norm("mlp_norm", spec)
    if spec.is_moe:
        # MixtralSparseMoeBlock: a bias-free router gate (h -> experts) and num_experts gated MLPs.
        tensors += _linear("moe.router", h, spec.num_experts, bias=False)
        for expert in range(spec.num_experts):
            tensors += _mlp(f"moe.experts.{expert}", spec)
    else:
        tensors += _mlp("mlp", spec)
    return tensors


def param_layout(spec: TransformerSpec) -> ParamLayout:
    """Every parameter tensor of `spec`, grouped into embedding, one block, and final modules."""
    h = spec.hidden_size
    embedding = [ParamTensor("embed_tokens.weight", spec.vocab_size * h, spec.vocab_size)]
    if spec.position_embedding == "learned":
        # GPT-2's wpe: one row per position up to n_positions.
        embedding.append(ParamTensor("embed_positions.weight", spec.max_position_embeddings * h, spec.max_position_embeddings))
    final = _norm("final_norm", spec)
    if not spec.tie_word_embeddings:
        final += _linear("lm_head", h, spec.vocab_size, bias=False)
    return ParamLayout(tuple(embedding), tuple(_block(spec)), spec.num_layers, tuple(final))

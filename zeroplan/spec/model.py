"""Model specs: what a model is, as validated data (no torch, no arithmetic beyond defaults).

Two kinds:
- `TransformerSpec`: a decoder-only transformer described by the fields a Hugging Face
  `config.json` carries. The flags cover the GPT-2 family (learned positions, LayerNorm with bias,
  GELU MLP, biases, tied embeddings), GPT-NeoX, and the Llama family (RMSNorm, gated MLP, rotary,
  grouped-query attention, optional qkv bias, a head_dim that differs from hidden/heads, tied or
  untied embeddings), and mixture-of-experts (Mixtral: a router and `num_experts` gated MLPs).
- `ParamCountSpec`: a model known only by its parameter count, for model-states-only estimates
  (what DeepSpeed's `estimate_zero*_model_states_mem_needs` take).

Parameter tensors are enumerated from a spec in `zeroplan.estimate.model.layout`. A transformer's dropout
rates change its activations, not its parameters; `TransformerSpec.dropout_rates` gives the rates a
run trains with.
"""

# No `from __future__ import annotations` here: pydantic would compile each field's annotation string
# (typing.ForwardRef) as the models are built, 2 ms of every command's start-up (bench/estimate_speed.py).

from typing import Annotated, Literal, NamedTuple, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from zeroplan.spec.limits import MAX_COUNT, MAX_LAYERS, MAX_WIDTH
from zeroplan.spec.moe import MLASpec, MoESpec, check_fits

_STRICT = ConfigDict(extra="forbid", frozen=True)

DropoutLayer = Literal["embedding", "attention", "residual"]

# The dropout layers each family's transformers 5.23.0 modeling file applies in training:
# GPT-2 GPT2Model.drop, GPT2Attention.attn_dropout / resid_dropout, GPT2MLP.dropout; GPT-NeoX
# emb_dropout, attention_dropout, post_attention_dropout / post_mlp_dropout; Phi-3
# resid_attn_dropout / resid_mlp_dropout and attention_dropout (Phi3Model has no embedding dropout,
# whatever embd_pdrop says); the Llama family (llama, mistral, mixtral, qwen2, gemma) attention only.
DROPOUT_LAYERS: dict[str, tuple[DropoutLayer, ...]] = {
    "gpt2": ("embedding", "attention", "residual"),
    "gpt_neox": ("embedding", "attention", "residual"),
    "phi3": ("attention", "residual"),
}
_ATTENTION_ONLY: tuple[DropoutLayer, ...] = ("attention",)


class DropoutRates(NamedTuple):
    """The dropout probabilities a run trains with (0: the layer keeps nothing)."""

    embedding: float = 0.0
    attention: float = 0.0
    residual: float = 0.0


class TransformerSpec(BaseModel):
    """A decoder-only transformer, field for field what its Hugging Face config says."""

    model_config = _STRICT

    kind: Literal["transformer"] = Field("transformer", description="Spec kind: a full transformer.")
    name: str = Field(description="Short name, e.g. llama-2-7b.")
    source: str | None = Field(None, description="Where the numbers come from (a config.json URL or paper).")
    hf_model_type: str | None = Field(
        None, description="Hugging Face model_type this spec was read from (llama, gpt2, ...), if any."
    )
    vocab_size: int = Field(ge=1, le=MAX_WIDTH, description="Vocabulary size (rows of the embedding matrix).")
    hidden_size: int = Field(ge=1, le=MAX_WIDTH, description="Model width h.")
    num_layers: int = Field(ge=1, le=MAX_LAYERS, description="Number of transformer blocks L.")
    num_heads: int = Field(ge=1, le=MAX_WIDTH, description="Attention (query) heads a.")
    num_kv_heads: int | None = Field(
        None, ge=1, le=MAX_WIDTH, description="Key/value heads for grouped-query attention; defaults to num_heads."
    )
    head_dim: int | None = Field(
        None, ge=1, le=MAX_WIDTH, description="Per-head width; defaults to hidden_size / num_heads (Gemma and Mistral-Nemo differ)."
    )
    intermediate_size: int = Field(ge=1, le=MAX_WIDTH, description="MLP inner width (GPT-2: n_inner, 4h by default).")
    max_position_embeddings: int = Field(ge=1, le=MAX_COUNT, description="Context length the model was built for.")
    position_embedding: Literal["learned", "rotary"] = Field(
        description="learned: a position-embedding matrix (GPT-2); rotary: RoPE, no parameters."
    )
    norm: Literal["layernorm", "rmsnorm"] = Field(
        description="layernorm has weight and bias (2h); rmsnorm has a weight only (h)."
    )
    mlp: Literal["gelu", "gated"] = Field(
        description="gelu: up and down projections; gated: gate, up and down (SwiGLU/GeGLU)."
    )
    attention_bias: bool = Field(False, description="Biases on the query, key and value projections.")
    attention_out_bias: bool = Field(False, description="Bias on the attention output projection.")
    mlp_bias: bool = Field(False, description="Biases on the MLP projections.")
    tie_word_embeddings: bool = Field(description="The output head shares the input embedding matrix.")
    num_experts: int = Field(1, ge=1, le=MAX_WIDTH, description="MLP experts per layer (1 = dense; Mixtral 8).")
    experts_per_token: int = Field(1, ge=1, le=MAX_WIDTH, description="Experts each token is routed to (top-k; Mixtral 2).")
    embedding_dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout probability on the embeddings (GPT-2 embd_pdrop, GPT-NeoX hidden_dropout)."
    )
    attention_dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout probability on the attention probabilities (GPT-2 attn_pdrop; "
        "attention_dropout elsewhere)."
    )
    residual_dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout probability on each block's attention and MLP outputs before the "
        "residual add (GPT-2 and Phi-3 resid_pdrop, GPT-NeoX hidden_dropout)."
    )
    published_params: int | None = Field(
        None, ge=1, le=MAX_COUNT, description="Total parameter count as published, checked by the tests."
    )
    # Dense families of transformers 5.23.0 (issue 13); the defaults are the Llama block's.
    qk_norm: Literal["none", "head", "projection"] = Field(
        "none", description="RMSNorm on queries and keys before rotary: head, one weight of head_dim shared by the "
        "heads (Qwen3Attention.q_norm/k_norm, Gemma3Attention); projection, one over the whole q and k projection "
        "(Olmo2Attention); transformers/models/<type>/modeling_<type>.py."
    )
    norm_placement: Literal["pre", "sandwich", "post"] = Field(
        "pre", description="Where a block's norms sit: pre, before attention and MLP (Llama); sandwich, before and "
        "after each (four norms, Gemma2DecoderLayer/Gemma3DecoderLayer); post, after each only, on the branch "
        "output before the residual add (Olmo2DecoderLayer)."
    )
    norm_weight_in_fp32: bool = Field(
        False, description="RMSNorm multiplies its weight into the fp32 normalised tensor and casts after "
        "(Gemma2RMSNorm, Gemma3RMSNorm, Olmo2RMSNorm), instead of casting first (LlamaRMSNorm)."
    )
    norm_unit_offset: bool = Field(
        False, description="RMSNorm scales by (1 + weight), its weight initialised to zero (Gemma2RMSNorm, Gemma3RMSNorm)."
    )
    embedding_scale: bool = Field(
        False, description="The embeddings are multiplied by sqrt(hidden_size) (Gemma2TextScaledWordEmbedding."
        "embed_scale, a buffer, not a parameter): a temporary, nothing saved."
    )
    attention_softcap: float | None = Field(
        None, gt=0, description="Attention logit soft-capping: scores = cap * tanh(scores / cap) before the softmax "
        "(Gemma 2 attn_logit_softcapping 50; eager_attention_forward in modeling_gemma2.py; SDPA cannot run it)."
    )
    final_logit_softcap: float | None = Field(
        None, gt=0, description="Final logit soft-capping: logits = cap * tanh(logits / cap) after lm_head "
        "(Gemma2ForCausalLM final_logit_softcapping 30)."
    )
    sliding_window: int | None = Field(
        None, ge=1, le=MAX_COUNT, description="Keys a sliding-window layer attends to (Gemma 2 4096, Gemma 3 512/1024); None: every "
        "layer attends to the whole sequence."
    )
    sliding_window_pattern: int = Field(
        1, ge=1, le=MAX_LAYERS, description="With sliding_window, every Nth layer (1-based) attends globally and the others through "
        "the window: Gemma 2 alternates (2), Gemma 3 has five local to one global (6); 1: every layer slides."
    )
    moe: MoESpec | None = Field(
        None, description="Experts narrower than intermediate_size, shared experts, dense layers (Qwen3-MoE, "
        "DeepSeek-V3, GPT-OSS): zeroplan.spec.moe."
    )
    mla: MLASpec | None = Field(None, description="Multi-head latent attention (DeepSeek-V3): zeroplan.spec.moe.")
    attention_sinks: bool = Field(False, description="A learned sink logit per head (GPT-OSS GptOssAttention.sinks).")
    notes: tuple[str, ...] = Field((), description="What the source holds that the spec does not model (a "
                                   "quantization_config, a vision tower), said in every estimate of it.")

    @model_validator(mode="after")
    def _check_moe_and_mla(self) -> "TransformerSpec":
        if self.moe is not None or self.mla is not None:
            check_fits(self.hidden_size, self.head_dim, self.num_heads, self.num_layers, self.moe, self.mla)
        return self

    @model_validator(mode="after")
    def _check_dropout(self) -> "TransformerSpec":
        for layer, rate in self.dropout_rates()._asdict().items():
            if rate and layer not in self.dropout_layers:
                raise ValueError(f"{layer}_dropout: {self.model_type} models have no {layer} dropout layer "
                                 f"(transformers modeling_{self.model_type}.py); they have {', '.join(self.dropout_layers)}")
        if self.model_type == "gpt_neox" and self.embedding_dropout != self.residual_dropout:
            raise ValueError(f"embedding_dropout {self.embedding_dropout} and residual_dropout {self.residual_dropout} "
                             "differ, but GPT-NeoX sets both from one hidden_dropout")
        return self

    @model_validator(mode="after")
    def _check_shapes(self) -> "TransformerSpec":
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads} (set head_dim to override)"
            )
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_kv_heads {self.kv_heads} does not divide num_heads {self.num_heads}")
        if self.sliding_window is None and self.sliding_window_pattern != 1:
            raise ValueError(f"sliding_window_pattern {self.sliding_window_pattern} needs a sliding_window")
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"experts_per_token {self.experts_per_token} exceeds num_experts {self.num_experts}"
            )
        return self

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def model_type(self) -> str:
        """The Hugging Face model_type, or the family the shape flags describe when none is given."""
        if self.hf_model_type:
            return self.hf_model_type
        if self.position_embedding == "learned":
            return "gpt2"
        if self.norm == "layernorm":
            return "gpt_neox"
        return "mixtral" if self.is_moe else "llama"

    @property
    def dropout_layers(self) -> tuple[DropoutLayer, ...]:
        """The dropout layers the family's modeling file has (`DROPOUT_LAYERS`)."""
        return DROPOUT_LAYERS.get(self.model_type, _ATTENTION_ONLY)

    def dropout_rates(self, override: float | None = None) -> DropoutRates:
        """The rates a run trains with: the config's, or `override` (`--dropout P`) on every
        dropout layer the family has."""
        if override is None:
            return DropoutRates(self.embedding_dropout, self.attention_dropout, self.residual_dropout)
        return DropoutRates(**{layer: override for layer in self.dropout_layers})


class ParamCountSpec(BaseModel):
    """A model known only by its size: enough for model states, not for activations."""

    model_config = _STRICT

    kind: Literal["params"] = Field("params", description="Spec kind: a parameter count only.")
    name: str = Field("custom", description="A label for reports.")
    params: int = Field(ge=1, le=MAX_COUNT, description="Total parameter count Ψ.")
    largest_layer_params: int | None = Field(
        None, ge=1, le=MAX_COUNT, description="Parameters of the largest layer (ZeRO-3 gathers one layer at a time)."
    )
    trainable_params: int | None = Field(
        None, ge=1, le=MAX_COUNT, description="Parameters that train (the rest are frozen: no gradients or optimizer states)."
    )
    source: str | None = Field(None, description="Where the count comes from.")

    @model_validator(mode="after")
    def _check_counts(self) -> "ParamCountSpec":
        if self.largest_layer_params is not None and self.largest_layer_params > self.params:
            raise ValueError(f"largest_layer_params {self.largest_layer_params} exceeds params {self.params}")
        if self.trainable_params is not None and self.trainable_params > self.params:
            raise ValueError(f"trainable_params {self.trainable_params} exceeds params {self.params}")
        return self


ModelSpec = Annotated[Union[TransformerSpec, ParamCountSpec], Field(discriminator="kind")]

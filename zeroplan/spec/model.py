"""Model specs: what a model is, as validated data (no torch, no arithmetic beyond defaults).

Two kinds:
- `TransformerSpec`: a decoder-only transformer described by the fields a Hugging Face
  `config.json` carries. The flags cover the GPT-2 family (learned positions, LayerNorm with bias,
  GELU MLP, biases, tied embeddings), GPT-NeoX, and the Llama family (RMSNorm, gated MLP, rotary,
  grouped-query attention, optional qkv bias, a head_dim that differs from hidden/heads, tied or
  untied embeddings), and mixture-of-experts (Mixtral: a router and `num_experts` gated MLPs).
- `ParamCountSpec`: a model known only by its parameter count, for model-states-only estimates
  (what DeepSpeed's `estimate_zero*_model_states_mem_needs` take).

Parameter tensors are enumerated from a spec in `zeroplan.estimate.layout`.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

_STRICT = ConfigDict(extra="forbid", frozen=True)


class TransformerSpec(BaseModel):
    """A decoder-only transformer, field for field what its Hugging Face config says."""

    model_config = _STRICT

    kind: Literal["transformer"] = Field("transformer", description="Spec kind: a full transformer.")
    name: str = Field(description="Short name, e.g. llama-2-7b.")
    source: str | None = Field(None, description="Where the numbers come from (a config.json URL or paper).")
    hf_model_type: str | None = Field(
        None, description="Hugging Face model_type this spec was read from (llama, gpt2, ...), if any."
    )
    vocab_size: int = Field(ge=1, description="Vocabulary size (rows of the embedding matrix).")
    hidden_size: int = Field(ge=1, description="Model width h.")
    num_layers: int = Field(ge=1, description="Number of transformer blocks L.")
    num_heads: int = Field(ge=1, description="Attention (query) heads a.")
    num_kv_heads: int | None = Field(
        None, ge=1, description="Key/value heads for grouped-query attention; defaults to num_heads."
    )
    head_dim: int | None = Field(
        None, ge=1, description="Per-head width; defaults to hidden_size / num_heads (Gemma and Mistral-Nemo differ)."
    )
    intermediate_size: int = Field(ge=1, description="MLP inner width (GPT-2: n_inner, 4h by default).")
    max_position_embeddings: int = Field(ge=1, description="Context length the model was built for.")
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
    num_experts: int = Field(1, ge=1, description="MLP experts per layer (1 = dense; Mixtral 8).")
    experts_per_token: int = Field(1, ge=1, description="Experts each token is routed to (top-k; Mixtral 2).")
    published_params: int | None = Field(
        None, ge=1, description="Total parameter count as published, checked by the tests."
    )

    @model_validator(mode="after")
    def _check_shapes(self) -> "TransformerSpec":
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads} (set head_dim to override)"
            )
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_kv_heads {self.kv_heads} does not divide num_heads {self.num_heads}")
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


class ParamCountSpec(BaseModel):
    """A model known only by its size: enough for model states, not for activations."""

    model_config = _STRICT

    kind: Literal["params"] = Field("params", description="Spec kind: a parameter count only.")
    name: str = Field("custom", description="A label for reports.")
    params: int = Field(ge=1, description="Total parameter count Ψ.")
    largest_layer_params: int | None = Field(
        None, ge=1, description="Parameters of the largest layer (ZeRO-3 gathers one layer at a time)."
    )
    trainable_params: int | None = Field(
        None, ge=0, description="Parameters that train (the rest are frozen: no gradients or optimizer states)."
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

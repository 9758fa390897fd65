"""Mixture-of-experts and multi-head latent attention: the fields of a `TransformerSpec` that
Qwen3-MoE, DeepSeek-V3 and GPT-OSS add (transformers 5.23.0 models/<type>/modeling_<type>.py).

- `MoESpec`: routed experts stored as fused 3-D tensors (Qwen3MoeExperts, DeepseekV3Experts,
  GptOssExperts), a router, shared experts (DeepseekV3MoE.shared_experts), dense layers among the
  sparse ones (DeepseekV3DecoderLayer: `first_k_dense_replace`; Qwen3MoeDecoderLayer:
  `mlp_only_layers` and `decoder_sparse_step`), and DeepSeek's multi-token-prediction layers, which
  transformers does not build (a knob, off unless set).
- `MLASpec`: DeepSeek-V3's multi-head latent attention (DeepseekV3Attention): low-rank query and
  key/value projections with their RMSNorms, and a rotary part of the query/key head split from the
  rest.

Mixtral keeps `TransformerSpec.num_experts` / `experts_per_token` (its experts are as wide as its
`intermediate_size`); these specs are for the families whose experts are not.
"""

# No `from __future__ import annotations` here: pydantic would compile each field's annotation string
# (typing.ForwardRef) as the models are built, 2 ms of every command's start-up (bench/estimate_speed.py).

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from zeroplan.spec.limits import MAX_LAYERS, MAX_WIDTH

_STRICT = ConfigDict(extra="forbid", frozen=True)

Router = Literal["softmax-topk", "sigmoid-grouped", "topk-softmax"]


class MoESpec(BaseModel):
    """Routed experts of a sparse MLP, and which layers keep a dense one."""

    model_config = _STRICT

    num_experts: int = Field(ge=1, le=MAX_WIDTH, description="Routed experts per sparse layer (num_experts, n_routed_experts, "
                             "num_local_experts).")
    experts_per_token: int = Field(ge=1, le=MAX_WIDTH, description="Experts each token is routed to (num_experts_per_tok).")
    expert_intermediate_size: int = Field(ge=1, le=MAX_WIDTH, description="Inner width of one routed expert (moe_intermediate_size; "
                                          "GPT-OSS: intermediate_size).")
    shared_expert_intermediate_size: int = Field(
        0, ge=0, le=MAX_WIDTH, description="Inner width of the shared expert every token runs (DeepSeek: moe_intermediate_size x "
        "n_shared_experts, one DeepseekV3MLP); 0: none.")
    dense_layers: tuple[int, ...] = Field(
        (), description="Layer indices (0-based) whose MLP is dense, of the spec's intermediate_size "
        "(DeepSeek: range(first_k_dense_replace); Qwen3-MoE: mlp_only_layers and decoder_sparse_step).")
    router: Router = Field(
        "softmax-topk", description="softmax-topk: fp32 softmax over all experts, then top-k (Qwen3MoeTopKRouter); "
        "sigmoid-grouped: fp32 sigmoid scores, group-limited top-k (DeepseekV3TopkRouter); topk-softmax: top-k of the "
        "logits, softmax over those k (GptOssTopKRouter).")
    router_bias: bool = Field(False, description="The router has a bias parameter (GPT-OSS).")
    expert_bias: bool = Field(False, description="Experts have biases on both projections (GPT-OSS).")
    mtp_layers: int = Field(
        0, ge=0, le=MAX_LAYERS, description="Multi-token-prediction layers a training recipe adds (DeepSeek num_nextn_predict_layers; "
        "transformers does not build them, so 0 unless set).")

    @model_validator(mode="after")
    def _check(self) -> "MoESpec":
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token {self.experts_per_token} exceeds num_experts {self.num_experts}")
        if len(set(self.dense_layers)) != len(self.dense_layers) or any(i < 0 for i in self.dense_layers):
            raise ValueError(f"dense_layers {list(self.dense_layers)}: layer indices must be distinct and 0 or more")
        return self

    def sparse(self, layer: int) -> bool:
        """Does layer `layer` (0-based) have routed experts?"""
        return layer not in self.dense_layers


class MLASpec(BaseModel):
    """DeepSeek's multi-head latent attention (DeepseekV3Attention.__init__)."""

    model_config = _STRICT

    q_lora_rank: int | None = Field(
        None, ge=1, le=MAX_WIDTH, description="Rank of the query's down-projection q_a_proj (None: one q_proj, as DeepSeek-V2-Lite).")
    kv_lora_rank: int = Field(ge=1, le=MAX_WIDTH, description="Rank of the compressed key/value kv_a_proj_with_mqa.")
    qk_rope_head_dim: int = Field(ge=2, le=MAX_WIDTH, description="Rotary part of each query/key head (shared by all heads for keys).")
    qk_nope_head_dim: int = Field(ge=1, le=MAX_WIDTH, description="Part of each query/key head without positions.")
    v_head_dim: int = Field(ge=1, le=MAX_WIDTH, description="Value head width.")

    @model_validator(mode="after")
    def _check(self) -> "MLASpec":
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} is odd; rotary embeddings rotate pairs")
        return self

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def check_fits(hidden_size: int, head_dim: int | None, num_heads: int, num_layers: int,
               moe: MoESpec | None, mla: MLASpec | None) -> None:
    """Cross-field rules between these specs and the transformer's shape: raises ValueError."""
    if moe is not None:
        beyond = [i for i in moe.dense_layers if i >= num_layers]
        if beyond:
            raise ValueError(f"moe.dense_layers: layer {beyond[0]} is beyond num_layers {num_layers}")
    if mla is None:
        return
    for field, rank in (("q_lora_rank", mla.q_lora_rank), ("kv_lora_rank", mla.kv_lora_rank)):
        if rank is not None and rank > hidden_size:
            raise ValueError(f"mla.{field} {rank} exceeds hidden_size {hidden_size}: not a low-rank projection")
    if mla.q_lora_rank is not None and mla.q_lora_rank > num_heads * mla.qk_head_dim:
        raise ValueError(f"mla.q_lora_rank {mla.q_lora_rank} exceeds the query width num_heads x "
                         f"(qk_nope_head_dim + qk_rope_head_dim) = {num_heads * mla.qk_head_dim}")
    if mla.kv_lora_rank > num_heads * (mla.qk_nope_head_dim + mla.v_head_dim):
        raise ValueError(f"mla.kv_lora_rank {mla.kv_lora_rank} exceeds the key/value width num_heads x "
                         f"(qk_nope_head_dim + v_head_dim) = {num_heads * (mla.qk_nope_head_dim + mla.v_head_dim)}")
    if head_dim != mla.qk_rope_head_dim:
        # DeepseekV3Config sets head_dim = qk_rope_head_dim: the rotary embedding's width.
        raise ValueError(f"head_dim {head_dim} differs from mla.qk_rope_head_dim {mla.qk_rope_head_dim} "
                         "(DeepseekV3Config: head_dim is the rotary width)")

"""Activation terms of the dense families' blocks (issue 13), added to the Llama block's of
`zeroplan.estimate.activations.transformer`; each is what the transformers 5.23.0 module that runs saves
(docs/engines/activations.md, "Dense families"). Zero for every model whose spec leaves the family
fields at their defaults, so the Llama, GPT-2 and Mixtral terms are untouched.

- q/k norms (Qwen3Attention.q_norm/k_norm and Gemma3Attention's: head_dim wide; Olmo2Attention's:
  projection wide): each RMSNorm keeps its fp32 input, the normalised tensor (in the input dtype,
  or fp32 where the weight multiplies before the cast: Gemma 3, OLMo 2) and rsqrt's fp32 output
  per row; its output feeds rotary, whose multiplies keep cos and sin only.
- Norms on the branch outputs (Gemma 2/3 post_attention_layernorm and post_feedforward_layernorm,
  OLMo 2's two norms): the same three tensors each; their outputs go to the residual add, which
  keeps nothing. OLMo 2 has no norm before attention or MLP: the projections keep the residual
  stream itself (or, under autocast, one 16-bit cast per matmul).
- Gemma's (1 + w) RMSNorm multiplies in fp32: the normalised tensor kept is fp32, not the
  residual's dtype (`norm_weight_in_fp32`).
- Attention logit soft-capping under eager attention (modeling_gemma2.py eager_attention_forward):
  scores / cap, tanh, * cap: tanh keeps its output, a x s per token in the scores' dtype. The
  divisions and multiplies by a Python float keep nothing. Fused kernels (flash-attention's
  softcap argument) keep no s x s tensor; SDPA cannot run it (Gemma2PreTrainedModel._supports_sdpa False).
- Final logit soft-capping (Gemma2ForCausalLM.forward): tanh keeps its output, vocab per token
  in the compute dtype, until the head's backward.
- Embedding scaling (Gemma2TextScaledWordEmbedding): the unscaled embedding is freed by the multiply
  (a temporary); the scale is a 0-d buffer. Nothing saved.
- Sliding windows: once the sequence reaches the window, transformers gives SDPA an explicit mask,
  which SDPA keeps as a float of the query's dtype (s x s per sequence), and repeats k and v to
  every head first; eager computes and masks the whole s x s scores either way (nothing more kept
  than full attention; under checkpointing a second, sliding, mask is kept beside the causal one).
- Gemma's (1 + w) RMSNorm keeps the fp32 vector 1 + w per norm; Gemma 3 keeps two rotary tables
  (local and global base frequencies).
"""

from __future__ import annotations

from zeroplan.estimate.dtypes import FP32_BYTES
from zeroplan.spec.model import TransformerSpec



def _rmsnorm_saved(spec: TransformerSpec, width: int, rows: int, input_bytes: int) -> int:
    """One RMSNorm over `rows` rows of `width` per token: fp32 input, normalised tensor, fp32 rsqrt."""
    normed = FP32_BYTES if spec.norm_weight_in_fp32 else input_bytes
    return FP32_BYTES * width * rows + normed * width * rows + FP32_BYTES * rows


def qk_norm_saved_per_token(spec: TransformerSpec, comp: int) -> int:
    """q_norm and k_norm on the projections' outputs (compute dtype)."""
    if spec.qk_norm == "none":
        return 0
    head = spec.dim_per_head
    if spec.qk_norm == "head":
        return _rmsnorm_saved(spec, head, spec.num_heads, comp) + _rmsnorm_saved(spec, head, spec.kv_heads, comp)
    return (_rmsnorm_saved(spec, spec.num_heads * head, 1, comp)
            + _rmsnorm_saved(spec, spec.kv_heads * head, 1, comp))


def output_norm_saved_per_token(spec: TransformerSpec, comp: int) -> int:
    """One norm on a branch output (o_proj's or down_proj's, compute dtype); zero for pre-norm blocks."""
    if spec.norm_placement == "pre":
        return 0
    return _rmsnorm_saved(spec, spec.hidden_size, 1, comp)


def post_norm_input_delta_per_token(spec: TransformerSpec, norm_saved: int, projections_input: int) -> int:
    """OLMo 2 has no norm before attention or MLP: instead of a norm's tensors (`norm_saved`), the
    matmuls keep their input (`projections_input`: the residual stream, or its autocast casts)."""
    return projections_input - norm_saved if spec.norm_placement == "post" else 0


def softcap_scores_per_token(spec: TransformerSpec, eager: bool, seq_len: int, comp: int) -> int:
    """tanh's output kept by eager attention's soft-capping: a x s per token."""
    if not (eager and spec.attention_softcap):
        return 0
    return comp * spec.num_heads * seq_len


def final_softcap_per_token(spec: TransformerSpec, comp: int) -> int:
    """tanh's output of the final logit soft-capping: vocab per token."""
    return comp * spec.vocab_size if spec.final_logit_softcap else 0


def sliding_layers(spec: TransformerSpec) -> int:
    """Layers that attend through the window: all but every `sliding_window_pattern`th."""
    if spec.sliding_window is None:
        return 0
    return spec.num_layers - spec.num_layers // spec.sliding_window_pattern


def sliding_saved_per_token(spec: TransformerSpec, kernel: str, seq_len: int, comp: int) -> int:
    """What SDPA keeps more in a sliding layer, averaged over the blocks (`sliding_layers` of them),
    once the sequence reaches the window (masking_utils._ignore_causal_mask_sdpa gives no mask
    below it). The boolean mask batch x 1 x s x s becomes a float mask of the query's dtype that
    SDPA keeps (aten attention.cpp convert_boolean_attn_mask), and with a mask transformers repeats
    k and v to num_heads before the call (integrations/sdpa_attention.py use_gqa_in_sdpa)."""
    if kernel == "eager" or not sliding_layers(spec) or seq_len < spec.sliding_window:
        return 0
    repeated = 2 * (spec.num_heads - spec.kv_heads) * spec.dim_per_head
    return comp * (seq_len + repeated) * sliding_layers(spec) // spec.num_layers


def offset_weights_bytes(spec: TransformerSpec, final: bool = False) -> int:
    """Gemma's (1 + w) RMSNorm keeps the fp32 `1.0 + self.weight.float()` it multiplies by: one
    vector per norm of a block (or of the final norm), independent of the tokens."""
    if not spec.norm_unit_offset:
        return 0
    if final:
        return FP32_BYTES * spec.hidden_size
    norms = {"pre": 2, "sandwich": 4, "post": 2}[spec.norm_placement] * spec.hidden_size
    if spec.qk_norm == "head":
        norms += 2 * spec.dim_per_head
    elif spec.qk_norm == "projection":
        norms += (spec.num_heads + spec.kv_heads) * spec.dim_per_head
    return FP32_BYTES * norms


def rotary_element_bytes(spec: TransformerSpec, resid: int) -> int:
    """Element size of the rotary cos/sin: the embeddings' dtype, but fp32 in OLMo 2, whose
    Olmo2RotaryEmbedding.forward does not cast them back (apply_rotary_pos_emb multiplies in fp32
    and casts q and k after)."""
    return FP32_BYTES if spec.model_type == "olmo2" else resid


def rotary_tables(spec: TransformerSpec) -> int:
    """Rotary cos/sin pairs the blocks keep: Gemma 3 rotates its sliding layers with a second base
    frequency (Gemma3TextModel's rotary_emb per layer type, rope_local_base_freq): two pairs."""
    both = 0 < sliding_layers(spec) < spec.num_layers
    return 2 if spec.model_type == "gemma3_text" and both else 1


def phi3_sdpa_saved_per_token(spec: TransformerSpec, kernel: str, selective: bool, comp: int) -> int:
    """What Phi3Attention keeps beyond separate q, k, v projections (modeling_phi3.py): v is a view
    of the fused qkv_proj output, so whoever keeps v keeps that whole storage (q + kv more); and
    rotary's torch.cat makes q contiguous in (batch, heads, seq, d), so SDPA's output comes out in
    that layout and sdpa_attention_forward's transpose(1, 2).contiguous() copies it for o_proj (q
    more). Under selective checkpointing the core's output is that copy (nothing more). Eager
    attention keeps nothing more than the Llama block (measured with and without grouped-query
    attention: tests/estimate/activations/test_families.py)."""
    if spec.model_type != "phi3" or kernel != "fused":
        return 0
    q_width = spec.num_heads * spec.dim_per_head
    kv_width = spec.kv_heads * spec.dim_per_head
    return comp * ((q_width + kv_width) + (0 if selective else q_width))

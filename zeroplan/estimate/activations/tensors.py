"""The tensors one block saves, one by one: what the caching-allocator replay cuts a block's saved bytes into.

transformer.py counts a block's saved bytes per token as sums; the replay (estimate/device/estimate.py) needs
them as the tensors autograd keeps, in the order it saves them, so that a freed block leaves the holes a real
one leaves (a Llama block saves tensors of the residual width, of the kv width, of the MLP's intermediate
width and per-token scalars, not residual-stream pieces). Listed here for transformers' Llama-family block
(LlamaDecoderLayer: RMSNorm, separate q/k/v and gate/up projections, a gated MLP) under SDPA's fused kernel
or eager attention, without dropout or autocast; tests/estimate/activations/test_tensors.py holds the list
against the tensors a real LlamaDecoderLayer saves (torch.autograd.graph.saved_tensors_hooks). Anything else
(MoE, MLA, GPT-2's fused c_attn, LayerNorm, dropout, autocast, the families' extra norms) returns () and the
replay keeps residual-stream pieces; transformer.py also drops a list whose sum is not the block's bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zeroplan.estimate.dtypes import FP32_BYTES
from zeroplan.spec.model import TransformerSpec

if TYPE_CHECKING:  # transformer.py imports this module
    from zeroplan.estimate.activations.transformer import AttentionCore, Widths


def llama_block_per_token(spec: TransformerSpec, core: "AttentionCore", w: "Widths", seq_len: int,
                          attn_reads: int, mlp_reads: int) -> tuple[int, ...]:
    """Bytes per token of each tensor a Llama-family block saves without checkpointing, in save order; () for
    another block (module docstring)."""
    llama = (spec.norm == "rmsnorm" and spec.norm_placement == "pre" and spec.mlp == "gated" and attn_reads == 3
             and mlp_reads == 2 and spec.moe is None and not spec.is_moe and spec.mla is None
             and not spec.attention_sinks and not w.autocast and core.kernel in ("fused", "eager") and not core.mask)
    if not llama:
        return ()
    h, inner = spec.hidden_size, spec.intermediate_size
    q = spec.num_heads * spec.dim_per_head
    kv = spec.kv_heads * spec.dim_per_head
    normed = FP32_BYTES if spec.norm_weight_in_fp32 else w.resid
    # LlamaRMSNorm.forward: pow and mul keep the fp32 input (the input itself when fp32), mul keeps rsqrt's
    # fp32 output, the weight multiply keeps the normalised tensor cast back; the projections keep its output
    norm = (FP32_BYTES * h, FP32_BYTES, normed * h, w.comp * h)
    if core.kernel == "fused":
        # torch's CPU/CUDA flash SDPA (_scaled_dot_product_flash_attention backward) keeps k, q, v (kv heads:
        # transformers' sdpa_attention_forward passes enable_gqa), its fp32 logsumexp per head and its output,
        # which o_proj's input is (the output's layout is already b, s, h, d)
        attention = (w.comp * kv, w.comp * q, w.comp * kv, FP32_BYTES * spec.num_heads, w.comp * q)
    else:
        # modeling_llama.eager_attention_forward: q @ k^T keeps k repeated (repeat_kv) and q; softmax(dtype=fp32)
        # its output; probs @ v the repeated v and the probabilities cast back (the same tensor when fp32);
        # o_proj the transposed output's contiguous copy
        scores = spec.num_heads * seq_len
        probs = (w.comp * scores,) if core.probs != core.softmax else ()
        attention = (w.comp * q, w.comp * q, core.softmax * scores, w.comp * q, *probs, w.comp * q)
    # LlamaMLP.forward down_proj(act_fn(gate_proj(x)) * up_proj(x)): SiLU keeps gate's output, the product
    # keeps SiLU's output and up's, down_proj keeps the product
    mlp = (w.comp * inner,) * 4
    return norm + attention + norm + mlp

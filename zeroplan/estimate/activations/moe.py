"""Activation terms of the mixture-of-experts and latent-attention blocks (Qwen3-MoE, DeepSeek-V3,
GPT-OSS), per token, as transformers 5.23.0 runs them; `zeroplan.estimate.activations.transformer` calls
these for a spec with `moe`, `mla` or attention sinks. Derivations: docs/engines/moe.md.

Experts run through transformers' grouped kernel (integrations/moe.py
`grouped_mm_experts_forward`, the default `experts_implementation` wherever torch has
grouped_mm): the token-expert pairs (S = tokens x top-k) are gathered, sorted by expert and
multiplied as one grouped matmul per projection, so what is kept scales with S, however the
tokens spread over the experts: a load imbalance changes no activation byte on one rank.
"""

from __future__ import annotations

from zeroplan.estimate.dtypes import FP32_BYTES
from zeroplan.spec.model import TransformerSpec

INT64_BYTES = 8


def gate_saved(spec: TransformerSpec) -> int:
    """Intermediate-width tensors a routed expert's activation keeps per token-expert pair.

    Default gate (integrations/moe.py `_default_apply_gate`): the gate_up output (2i, kept through
    the chunk views read by SiLU and the product), SiLU's output, the product (down's input): 4.
    GPT-OSS (GptOssExperts._apply_gate): gate_up (2i, kept by both clamps through its strided
    views), the clamped gate, sigmoid's output, up + 1, the gated product and the output: 7."""
    return 7 if spec.hf_model_type == "gpt_oss" else 4


def _router_saved(spec: TransformerSpec, comp: int) -> int:
    moe = spec.moe
    experts, k = moe.num_experts, moe.experts_per_token
    if moe.router == "topk-softmax":
        # GptOssTopKRouter: topk over the logits keeps its indices; softmax over the k values its output.
        return INT64_BYTES * k + comp * k
    if moe.router == "sigmoid-grouped":
        # DeepseekV3TopkRouter: the fp32 copy of the input that the fp32 linear keeps (the input
        # itself in fp32), sigmoid's fp32 output, gather's index, the normalised weights (in-place
        # division keeps its result and the fp32 sum). The group top-k branch only picks indices:
        # its graph is freed with its discarded values.
        upcast = FP32_BYTES * spec.hidden_size if comp != FP32_BYTES else 0
        return upcast + FP32_BYTES * experts + INT64_BYTES * k + FP32_BYTES * (k + 1)
    # Qwen3MoeTopKRouter: fp32 softmax over all experts, top-k's indices, the normalised weights.
    return FP32_BYTES * experts + INT64_BYTES * k + FP32_BYTES * (k + 1)


def _pair_saved(spec: TransformerSpec, comp: int) -> int:
    """Kept per token-expert pair by grouped_mm_experts_forward: the gathered input (read by the
    gate_up grouped matmul), the activation's tensors, the down output and the pair's weight (both
    kept by the weighting multiply), and three int64 index tensors (the gather by perm // k, the
    weights' gather by perm, the un-permute by inv_perm); GPT-OSS's two bias gathers share a fourth."""
    h, inner = spec.hidden_size, spec.moe.expert_intermediate_size
    indices = 3 + (1 if spec.moe.expert_bias else 0)
    return comp * (2 * h + gate_saved(spec) * inner + 1) + INT64_BYTES * indices


def sparse_mlp_saved_per_token(spec: TransformerSpec, comp: int) -> int:
    """A sparse MLP's saved bytes per token: router, routed pairs, and the shared expert's gated
    MLP (DeepseekV3MoE.shared_experts: gate, SiLU, up, product)."""
    moe = spec.moe
    shared = 4 * comp * moe.shared_expert_intermediate_size
    return _router_saved(spec, comp) + moe.experts_per_token * _pair_saved(spec, comp) + shared


def _dense_saved(spec: TransformerSpec, comp: int) -> int:
    return 4 * comp * spec.intermediate_size  # gate, SiLU(gate), up, product (LlamaMLP's)


def _sparse_wins(spec: TransformerSpec, comp: int) -> bool:
    """Is the last block (forward order) sparse? Its terms stand for every block's, and
    `mixed_blocks_bytes` corrects the saved bytes to the mean over the blocks of both kinds
    (docs/engines/moe.md, "Blocks of two kinds")."""
    return spec.moe.sparse(spec.num_layers - 1)


def mlp_saved_per_token(spec: TransformerSpec, comp: int) -> int:
    return sparse_mlp_saved_per_token(spec, comp) if _sparse_wins(spec, comp) else _dense_saved(spec, comp)


def mixed_blocks_bytes(spec: TransformerSpec, tokens: int, comp: int) -> int:
    """What one block's saved bytes change by when every block keeps the mean over the dense and
    sparse blocks (DeepSeek's first_k_dense_replace, Qwen3-MoE's mlp_only_layers), rather than the
    last block's: exact for the whole forward, the moment the step peaks in."""
    if spec.moe is None:
        return 0
    dense = sum(1 for i in range(spec.num_layers) if not spec.moe.sparse(i))
    sparse = spec.num_layers - dense
    last = mlp_saved_per_token(spec, comp) * tokens + router_weight_copy_bytes(spec, comp)
    sparse_block = sparse_mlp_saved_per_token(spec, comp) * tokens + _router_weight_copy(spec, comp)
    total = dense * _dense_saved(spec, comp) * tokens + sparse * sparse_block
    return total // spec.num_layers - last


def _backward_moment(spec: TransformerSpec, resid: int, comp: int) -> tuple[int, int]:
    """(allocated, freed) per token at the peak of a sparse MLP's backward: the larger, net of the
    saved tensors freed by then, of two moments. The weighting multiply's backward: the gradient
    of the un-permuted copy (index_put into zeros), of the down output, and the product that
    reduces to the weights' gradient, three S x h, nothing freed yet. The gate activation's
    backward: four intermediate-width gradients per pair (the product's, SiLU's, up's, their
    concatenation into gate_up's; GPT-OSS's clamps and strided views make six), the down output,
    the pair weights and the product freed. Both beside the block output's gradient."""
    moe, h = spec.moe, spec.hidden_size
    k, inner = moe.experts_per_token, moe.expert_intermediate_size
    weighting = (resid * h + 3 * k * comp * h, 0)
    per_pair = 6 if spec.hf_model_type == "gpt_oss" else 4
    gate = (resid * h + per_pair * k * comp * inner, k * comp * (h + inner + 1))
    return max(weighting, gate, key=lambda moment: moment[0] - moment[1])


def idle_expert_params(spec: TransformerSpec) -> int:
    """Parameters a token does not run: the routed experts it is not sent to, in every sparse
    layer (GPT-OSS's expert biases included)."""
    moe, h = spec.moe, spec.hidden_size
    inner = moe.expert_intermediate_size
    expert = 3 * h * inner + ((2 * inner + h) if moe.expert_bias else 0)
    sparse_layers = sum(1 for i in range(spec.num_layers) if moe.sparse(i))
    return sparse_layers * (moe.num_experts - moe.experts_per_token) * expert


def first_block_gradient(spec: TransformerSpec) -> int | None:
    """Gradient elements of a sparse last block alive at its MLP's backward peak
    (`_backward_moment`), where the engines otherwise take its output projection's .grad
    (engines/common.py `early_gradients`): none at the weighting multiply's moment, the experts'
    down_proj (and bias) at the gate activation's, its grouped matmul's backward having run.
    None for a dense last block."""
    if spec.moe is None or not _sparse_wins(spec, 1):
        return None
    moe, h = spec.moe, spec.hidden_size
    allocated, freed = _backward_moment(spec, 1, 1)
    if not freed:  # the weighting multiply's moment: before any expert weight's gradient
        return 0
    return moe.num_experts * h * (moe.expert_intermediate_size + (1 if moe.expert_bias else 0))


def mlp_backward_transient_per_token(spec: TransformerSpec, resid: int, comp: int) -> int:
    """Gradients in flight at the peak of the MLP's backward (`_backward_moment`); a dense MLP's:
    activations.py `_block_backward_transient_per_token`."""
    if not _sparse_wins(spec, comp):
        return resid * spec.hidden_size + 3 * comp * spec.intermediate_size
    return _backward_moment(spec, resid, comp)[0]


def mlp_backward_freed_per_token(spec: TransformerSpec, resid: int, comp: int) -> int:
    """Saved tensors the MLP's backward has freed by its peak (`_backward_moment`); dense: the product."""
    if not _sparse_wins(spec, comp):
        return comp * spec.intermediate_size
    return _backward_moment(spec, resid, comp)[1]


def mlp_forward_transient_per_token(spec: TransformerSpec, resid: int, comp: int, checkpointed: bool) -> int:
    """Live in the last block's forward beyond its saved tensors: the weighted pairs and their
    un-permuted copy (two S x h) beside the block's output being written; under checkpointing,
    one pair's activation tensors as well."""
    h = spec.hidden_size
    if not _sparse_wins(spec, comp):
        inner = 3 * comp * spec.intermediate_size if checkpointed else 0
        return resid * h + comp * h + inner
    moe = spec.moe
    pairs = 2 * moe.experts_per_token * comp * h
    if checkpointed:
        pairs += moe.experts_per_token * comp * (h + gate_saved(spec) * moe.expert_intermediate_size)
    return resid * h + comp * h + pairs


def router_weight_copy_bytes(spec: TransformerSpec, comp: int) -> int:
    """DeepseekV3TopkRouter casts its weight to fp32 for the linear, which keeps the copy (a
    16-bit model's; an fp32 weight is its own)."""
    if spec.moe is None or not _sparse_wins(spec, comp):
        return 0
    return _router_weight_copy(spec, comp)


def _router_weight_copy(spec: TransformerSpec, comp: int) -> int:
    if spec.moe.router != "sigmoid-grouped" or comp == FP32_BYTES:
        return 0
    return FP32_BYTES * spec.moe.num_experts * spec.hidden_size


def qk_norm_saved_per_token(spec: TransformerSpec, comp: int) -> int:
    """Qwen3MoeAttention's q_norm and k_norm (RMSNorm over head_dim): the fp32 upcast, the
    normalised tensor cast back (kept by the weight multiply), rsqrt per head; their output goes
    through rotary multiplies that keep cos and sin only."""
    if spec.hf_model_type != "qwen3_moe":
        return 0
    d = spec.dim_per_head
    widths = (spec.num_heads + spec.kv_heads) * d
    return (FP32_BYTES + comp) * widths + FP32_BYTES * (spec.num_heads + spec.kv_heads)


def _rms_saved(width: int, comp: int) -> int:
    # upcast, normalised cast back, rsqrt, and the output read by the next projection
    return FP32_BYTES * width + comp * width + FP32_BYTES + comp * width


def mla_saved_per_token(spec: TransformerSpec, comp: int) -> int:
    """DeepseekV3Attention under a fused kernel, per token: q_a_layernorm's and kv_a_layernorm's
    tensors (their outputs kept by q_b_proj and kv_b_proj), then what SDPA keeps: the query and
    the key assembled from the no-rope and rope parts (heads x (nope + rope) each), the value, a
    view of kv_b_proj's output that keeps all of it (heads x (nope + v)), the output and the
    fp32 log-sum-exp; then o_proj keeps the output's transposed copy (the query, made by torch.cat,
    is head-major, so the kernel's output is too and `.transpose(1, 2).contiguous()` copies). In fp32 kv_a_layernorm's upcast is a no-op view: the whole compressed
    output (kv_lora_rank + rope) stays."""
    mla, heads = spec.mla, spec.num_heads
    q_path = _rms_saved(mla.q_lora_rank, comp) if mla.q_lora_rank else 0
    kv_norm = _rms_saved(mla.kv_lora_rank, comp) + (FP32_BYTES * mla.qk_rope_head_dim if comp == FP32_BYTES else 0)
    qk = 2 * comp * heads * mla.qk_head_dim
    value_storage = comp * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    out = 2 * comp * heads * mla.v_head_dim
    return q_path + kv_norm + qk + value_storage + out + FP32_BYTES * heads


def mla_eager_saved_per_token(spec: TransformerSpec, comp: int) -> int:
    """DeepseekV3Attention under eager attention (modeling_deepseek_v3.eager_attention_forward), per token and
    without the s x s probabilities (the caller's), as its saved tensors showed (torch 2.13.0, transformers
    5.23.0): q @ k^T keeps the assembled query and a contiguous copy of the transposed key (heads x (nope + rope)
    each); probs @ v keeps a contiguous copy of the value (heads x v), not kv_b_proj's whole output as the fused
    kernel's view does; the matmul's output is read by `.transpose(1, 2).contiguous()` alone, whose copy o_proj
    keeps; no kernel output or log-sum-exp. So: `mla_saved_per_token` less kv_b_proj's output and the kernel's
    output and log-sum-exp, plus the value's copy."""
    mla, heads = spec.mla, spec.num_heads
    return (mla_saved_per_token(spec, comp) - comp * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
            - comp * heads * mla.v_head_dim - FP32_BYTES * heads + comp * heads * mla.v_head_dim)


def sinks_probs_saved(comp: int) -> tuple[int, int]:
    """GPT-OSS eager attention with sinks (modeling_gpt_oss.eager_attention_forward): the softmax
    output over s + 1 logits in the scores' dtype (no fp32 upcast), which the matmul with v reads
    through a slice; returns (bytes per score, bytes per head and token: the sink column and the
    int64 index max keeps for its backward)."""
    return comp, comp + INT64_BYTES


def gpt_oss_norm_extra_per_token(spec: TransformerSpec, comp: int) -> int:
    """GptOssRMSNorm multiplies the weight in fp32 and casts after: the multiply keeps the fp32
    normalised tensor, not a cast back to the compute dtype."""
    return (FP32_BYTES - comp) * spec.hidden_size if spec.hf_model_type == "gpt_oss" else 0

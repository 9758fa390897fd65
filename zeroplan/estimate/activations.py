"""Activation memory: the tensors autograd keeps from the forward pass for the backward pass.

Starting point: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.1: a GPT block keeps sbh(34 + 5as/h) bytes in 16-bit with dropout. That count
assumes dropout masks, unfused attention and a GELU MLP. The modelled implementation is Hugging
Face transformers' (modeling_llama.py, modeling_gpt2.py) trained without dropout, as zeroplan's
measure mode runs it, so the terms below are what *those* modules save, tensor by tensor:

- RMSNorm (LlamaRMSNorm.forward): upcasts its input to fp32 (kept by pow and mul), keeps the
  normalised tensor cast back (kept by the weight multiply), and rsqrt's fp32 output per token;
  its output is kept by the projections that read it.
- LayerNorm (aten native_layer_norm): keeps input, mean and rstd (fp32 per token); output kept by
  the next linear.
- Attention, fused (scaled_dot_product_attention, flash/efficient kernels): keeps q, k, v, the
  output and a fp32 log-sum-exp per head and token; no s x s matrix (Dao et al. 2022, section 3.1).
  Grouped-query attention keeps k and v at num_kv_heads width.
- Attention, eager (eager_attention_forward): keeps q, k and v expanded to num_heads (repeat_kv),
  the fp32 softmax output a x s x s, and its cast to the compute dtype when that is 16-bit.
- Gated MLP (LlamaMLP): gate output (SiLU input), SiLU output, up output, their product.
- GPT-2 MLP with gelu_new (NewGELUActivation, written out in Python): c_fc output, tanh output,
  0.5*x, 1+tanh, and the product fed to c_proj: five tensors of intermediate width.
- Mixture of experts (MixtralSparseMoeBlock): router logits (fp32 softmax over experts), and the
  gated-MLP tensors for each token-expert pair (top-k of them), plus the gathered expert inputs.
- Logits and loss (ForCausalLMLoss): lm_head output (vocab x tokens, compute dtype, held by the
  model output), an fp32 upcast during the loss, and log_softmax's fp32 output kept for backward.
Checkpointing (Korthikanti section 5): `full` keeps each block's input only and recomputes one
block at a time in backward; `selective` recomputes the attention core only, which removes the
s x s terms of eager attention (fused attention already recomputes them).
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.training import Attention, Checkpointing, TrainingSpec

FP32_BYTES = 4


@dataclass(frozen=True)
class ActivationBytes:
    """Activation bytes of one micro-batch on one rank."""

    saved_per_block: int  # kept by one block until its backward
    recompute_block: int  # one block's full activations, rebuilt in backward under checkpointing
    embedding: int  # kept by the embedding (GPT-2's positions add; none for Llama)
    final_norm: int  # kept by the final norm
    logits: int  # lm_head output held by the model output, in the compute dtype
    loss_saved: int  # log_softmax's fp32 output kept for backward
    loss_transient: int  # fp32 upcast alive while the loss is computed
    logits_grad: int  # gradients of the logits alive at the start of backward
    num_blocks: int

    @property
    def forward_end(self) -> int:
        """Bytes held when the forward pass ends (loss computed)."""
        return self.embedding + self.num_blocks * self.saved_per_block + self.final_norm + self.logits + self.loss_saved

    @property
    def forward_peak(self) -> int:
        return self.forward_end + self.loss_transient

    @property
    def backward_start_peak(self) -> int:
        """Start of backward: all saved tensors plus the gradients of the logits."""
        return self.forward_end + self.logits_grad


def _norm_saved_per_token(spec: TransformerSpec, act_bytes: int) -> int:
    h = spec.hidden_size
    if spec.norm == "rmsnorm":
        # fp32 copy of the input (pow, mul), normalised cast back (weight mul), rsqrt (fp32/token).
        return FP32_BYTES * h + act_bytes * h + FP32_BYTES
    # native_layer_norm keeps its input plus fp32 mean and rstd per token.
    return act_bytes * h + 2 * FP32_BYTES


def _attention_saved_per_token(spec: TransformerSpec, training: TrainingSpec, act_bytes: int) -> int:
    q_width = spec.num_heads * spec.dim_per_head
    kv_width = spec.kv_heads * spec.dim_per_head
    norm_out = act_bytes * spec.hidden_size  # read by the q/k/v projections
    out = act_bytes * q_width  # attention output, read by o_proj
    if training.attention == Attention.FUSED:
        qkv = act_bytes * (q_width + 2 * kv_width)
        lse = FP32_BYTES * spec.num_heads
        return norm_out + qkv + out + lse
    # eager: k and v repeated to num_heads, fp32 softmax output per query row (s keys each).
    qkv = act_bytes * 3 * q_width
    probs = 0
    if training.checkpointing != Checkpointing.SELECTIVE:
        probs_per_element = FP32_BYTES + (act_bytes if act_bytes != FP32_BYTES else 0)
        probs = probs_per_element * spec.num_heads * training.seq_len
    return norm_out + qkv + out + probs


def _mlp_saved_per_token(spec: TransformerSpec, act_bytes: int) -> int:
    h, inner = spec.hidden_size, spec.intermediate_size
    norm_out = act_bytes * h
    if spec.mlp == "gated":
        dense = 4 * act_bytes * inner  # gate, SiLU(gate), up, product
    else:
        dense = 5 * act_bytes * inner  # gelu_new written out: x, tanh, 0.5x, 1+tanh, product
    if not spec.is_moe:
        return norm_out + dense
    k = spec.experts_per_token
    router = FP32_BYTES * spec.num_experts * 2  # router logits and their fp32 softmax
    gathered_inputs = k * act_bytes * h  # each expert's gathered token rows
    return norm_out + router + gathered_inputs + k * dense


def activation_bytes(spec: TransformerSpec, training: TrainingSpec, act_bytes: int) -> ActivationBytes:
    """Activations of one micro-batch of `training.micro_batch` x `training.seq_len` tokens."""
    tokens = training.micro_batch * training.seq_len
    block_per_token = (
        _norm_saved_per_token(spec, act_bytes)
        + _attention_saved_per_token(spec, training, act_bytes)
        + _norm_saved_per_token(spec, act_bytes)
        + _mlp_saved_per_token(spec, act_bytes)
    )
    full_block = tokens * block_per_token
    if training.checkpointing == Checkpointing.FULL:
        # torch.utils.checkpoint keeps the block input only (Korthikanti section 5: 2sbh in 16-bit).
        saved_block = tokens * act_bytes * spec.hidden_size
    else:
        saved_block = full_block
    embedding = 0
    if spec.position_embedding == "learned":
        embedding = 0  # token + position embedding add keeps nothing; its output is the block input
    vocab = spec.vocab_size
    logits = tokens * act_bytes * vocab
    loss_saved = tokens * FP32_BYTES * vocab
    upcast = tokens * FP32_BYTES * vocab if act_bytes != FP32_BYTES else 0
    # Backward of nll_loss then log_softmax: two fp32 vocab-wide gradients, then the cast to the
    # compute dtype for lm_head's backward.
    logits_grad = 2 * tokens * FP32_BYTES * vocab
    return ActivationBytes(
        saved_per_block=saved_block,
        recompute_block=full_block if training.checkpointing == Checkpointing.FULL else 0,
        embedding=embedding,
        final_norm=tokens * _norm_saved_per_token(spec, act_bytes),
        logits=logits,
        loss_saved=loss_saved,
        loss_transient=upcast,
        logits_grad=logits_grad,
        num_blocks=spec.num_layers,
    )

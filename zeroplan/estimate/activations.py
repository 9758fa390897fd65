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

    saved_per_block: int  # kept by one block until its backward (its input only under full checkpointing)
    recompute_block: int  # one block's activations rebuilt in backward under full checkpointing
    block_backward_transient: int  # gradients in flight at the peak of one block's backward
    embedding: int  # kept outside the blocks for the whole step (token ids, shifted labels)
    final_norm: int  # kept by the final norm, its output (lm_head's input) included
    logits: int  # lm_head output in the compute dtype, alive until the loss is computed
    loss_saved: int  # log_softmax's fp32 output kept for backward
    loss_transient: int  # fp32 upcast of the logits alive while the loss is computed (16-bit only)
    logits_grad: int  # nll_loss's and log_softmax's fp32 gradients, alive together
    num_blocks: int

    @property
    def blocks_saved(self) -> int:
        return self.embedding + self.num_blocks * self.saved_per_block

    @property
    def forward_end(self) -> int:
        """Bytes held when the forward pass has returned the loss (the logits are freed then:
        log_softmax keeps its output, not its input)."""
        return self.blocks_saved + self.final_norm + self.loss_saved

    @property
    def forward_peak(self) -> int:
        """While the loss is computed: every saved tensor, the logits, their fp32 upcast and
        log_softmax's output."""
        return self.blocks_saved + self.final_norm + self.logits + self.loss_transient + self.loss_saved

    @property
    def backward_start_peak(self) -> int:
        """log_softmax's backward: its saved output plus the gradients of nll_loss and of log_softmax."""
        return self.forward_end + self.logits_grad

    def block_backward_peak(self, blocks_left: int) -> int:
        """Inside the backward of a block when `blocks_left` blocks (itself included) still hold
        their saved tensors: the final norm and the loss are gone by then."""
        return self.embedding + blocks_left * self.saved_per_block + self.recompute_block + self.block_backward_transient


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


def _block_backward_transient_per_token(spec: TransformerSpec, act_bytes: int) -> int:
    """Gradients in flight at the peak of a block's backward, beyond its saved tensors.

    The block's backward starts with the gradient of its output (width h, kept until the residual
    add sums it). The MLP's last product (silu(gate) * up, or gelu_new's 0.5x * (1 + tanh)) is
    read by down_proj / c_proj, whose backward frees it and returns the product's gradient
    (intermediate width); the product's backward (aten mul) then returns two more gradients of
    intermediate width while that one is alive (torch/csrc/autograd/FunctionsManual.cpp
    mul_tensor_backward, one per factor). Net: h + 3 x inner - inner. Seen on tiny-llama and
    tiny-gpt2 (fsdp2, gloo): the peak of the last block's backward sits exactly there.
    """
    k = spec.experts_per_token if spec.is_moe else 1
    return act_bytes * (spec.hidden_size + 2 * k * spec.intermediate_size)


def _block_input_shared_bytes(spec: TransformerSpec, act_bytes: int) -> int:
    """Per token: the part of a recomputed block that is the checkpoint's own saved input.

    LayerNorm saves its input tensor itself; RMSNorm saves `hidden_states.to(torch.float32)`,
    which is the input itself when the input already is fp32 (modeling_llama.LlamaRMSNorm)."""
    if spec.norm != "rmsnorm" or act_bytes == FP32_BYTES:
        return act_bytes * spec.hidden_size
    return 0


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
    recompute = 0
    if training.checkpointing == Checkpointing.FULL:
        # torch.utils.checkpoint keeps the block input only (Korthikanti section 5: 2sbh in 16-bit),
        # and rebuilds the block's saved tensors in its backward, the input excepted when the
        # first norm saves that very tensor.
        saved_block = tokens * act_bytes * spec.hidden_size
        recompute = full_block - tokens * _block_input_shared_bytes(spec, act_bytes)
    else:
        saved_block = full_block
    # Kept outside the blocks: the token ids (int64, embedding's backward reads them) and the
    # shifted labels nll_loss saves (loss_utils.ForCausalLMLoss pads and shifts them: int64).
    # (Llama's rotary cos/sin, 2 x seq x head_dim in the compute dtype, are shared by the batch
    # and left out: under 0.5% of the activations of the smallest catalogue model.)
    int64_bytes = 8
    embedding = 2 * tokens * int64_bytes
    vocab = spec.vocab_size
    logits = tokens * act_bytes * vocab
    loss_saved = tokens * FP32_BYTES * vocab
    upcast = tokens * FP32_BYTES * vocab if act_bytes != FP32_BYTES else 0
    # Backward of nll_loss (a zero-filled fp32 gradient, aten nll_loss_backward) and of
    # log_softmax (_log_softmax_backward_data): both alive with log_softmax's saved output.
    logits_grad = 2 * tokens * FP32_BYTES * vocab
    # The final norm keeps what a block's norm keeps, and its output is saved by lm_head.
    final_norm = tokens * (_norm_saved_per_token(spec, act_bytes) + act_bytes * spec.hidden_size)
    return ActivationBytes(
        saved_per_block=saved_block,
        recompute_block=recompute,
        block_backward_transient=tokens * _block_backward_transient_per_token(spec, act_bytes),
        embedding=embedding,
        final_norm=final_norm,
        logits=logits,
        loss_saved=loss_saved,
        loss_transient=upcast,
        logits_grad=logits_grad,
        num_blocks=spec.num_layers,
    )

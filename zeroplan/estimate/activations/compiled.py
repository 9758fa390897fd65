"""torch.compile of the transformer blocks and of the loss (issue 23): what inductor's compiled graphs keep for
backward in place of what the eager modules keep (derivation and measurements: docs/engines/programs.md,
"torch.compile").

A compiled block is one joint forward-backward graph that AOTAutograd splits with the min-cut partitioner
(torch/_functorch/partitioners.py `min_cut_rematerialization_partition`): it saves the outputs of the ops it
may not recompute (matmuls, the attention kernel) that backward reads, and recomputes the pointwise ops and
reductions from them, fused into backward's kernels. For a Llama block (RMSNorm, rotary, SDPA, SwiGLU) the
saved set, read from the graphs inductor ran on CPU (torch 2.13.0), is per token: the block's input (the first
norm's backward), the two norms' outputs as the matmuls read them and the attention output as o_proj reads it
(compute dtype), SDPA's q, k, v, output and log-sum-exp, the MLP's gate and up outputs and their SiLU product
(down_proj's input), and the two norms' rstd; not the norms' fp32 upcasts, their normalised outputs or SiLU's
output, which eager keeps. The compiled loss (torchtitan's `cross_entropy_loss` under torch.compile) keeps the
logits as it receives them and the log-sum-exp per token, and its backward writes one gradient of the logits in
their dtype: eager's fp32 upcast, log_softmax output and two fp32 gradients are gone.

What backward allocates in flight (the blocks' transients) is left as eager's, and per-op checkpointing keeps
what its policy saves either way: neither is measured to change here (the grid's compiled rows peak at the
loss). Other families and the chunked and fused losses are estimated as eager, with a note.
"""

from __future__ import annotations

from zeroplan.estimate.model.layout import param_layout
from zeroplan.estimate.terms import register, relabel
from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.program import Loss
from zeroplan.spec.training import Attention, Checkpointing, TrainingSpec

FP32_BYTES = 4

_PARTITIONER = "torch/_functorch/partitioners.py min_cut_rematerialization_partition (docs/engines/programs.md, torch.compile)"
register({  # tensors of the logits' shape
    "compiled loss: logits and log-sum-exp kept for backward": "torch.compile of the cross-entropy, " + _PARTITIONER,
    "compiled loss: the logits' gradient": "torch.compile of the cross-entropy (one fused backward kernel; "
                                           "docs/engines/programs.md, torch.compile)",
}, pieces="logits")
register({
    "activations saved by compiled blocks": _PARTITIONER,
    "head weight's 16-bit gradient (autocast)": "torch/csrc/autograd: the head mm's grad_weight before ToCopyBackward "
                                                "of autocast's weight cast (docs/engines/programs.md, torch.compile)",
})


def compiles_block(spec: TransformerSpec, training: TrainingSpec) -> bool:
    """Is `spec`'s block one whose compiled saved set is modelled (a dense Llama-family block, fused attention,
    no dropout), under a checkpointing that keeps its tensors (none) or rebuilds them (full)?"""
    dense_llama = (spec.norm == "rmsnorm" and spec.mlp == "gated" and spec.position_embedding == "rotary"
                   and not spec.is_moe and spec.mla is None and spec.qk_norm == "none" and spec.norm_placement == "pre"
                   and not spec.attention_sinks and spec.attention_softcap is None)
    return (dense_llama and training.attention == Attention.FUSED
            and training.checkpointing in (Checkpointing.NONE, Checkpointing.FULL)
            and not any(spec.dropout_rates(training.dropout)))


def compiled_block_saved_per_token(spec: TransformerSpec, resid: int, comp: int) -> int:
    """Bytes per token a compiled Llama block keeps for backward (module docstring): `resid` the residual
    stream's element size (fp32 under autocast), `comp` the matmuls' (the compute dtype)."""
    h, inner = spec.hidden_size, spec.intermediate_size
    q_width = spec.num_heads * spec.dim_per_head
    kv_width = spec.kv_heads * spec.dim_per_head
    matmul_inputs = 2 * h + q_width + inner  # the norms' outputs, the attention output, SiLU(gate) * up
    attention = 2 * q_width + 2 * kv_width  # SDPA's q, k, v and output
    mlp = 2 * inner  # gate and up outputs
    stats = FP32_BYTES * (spec.num_heads + 2)  # SDPA's log-sum-exp per head, the two norms' rstd
    return resid * h + comp * (matmul_inputs + attention + mlp) + stats


def compiled_changes(acts, spec: TransformerSpec, training: TrainingSpec, act_bytes: int, resid: int) -> dict[str, int]:
    """The ActivationBytes fields torch.compile changes (`training.compile`), for `acts` of one micro-batch."""
    tokens = training.micro_batch * training.seq_len
    changes: dict[str, int] = {}
    if "model" in training.compile and compiles_block(spec, training):
        saved = relabel("activations saved by compiled blocks",
                        tokens * compiled_block_saved_per_token(spec, resid, act_bytes) + _unchanged_block_bytes(acts, spec, tokens, resid, act_bytes))
        if training.checkpointing == Checkpointing.FULL:
            # the block keeps its input; its backward rebuilds what the compiled graph saves
            changes["recompute_block"] = saved - acts.saved_per_block
        else:
            changes["saved_per_block"] = saved
    if "loss" in training.compile and training.program.loss == Loss.STANDARD:
        vocab = spec.vocab_size
        upcast = tokens * vocab * FP32_BYTES if act_bytes != FP32_BYTES else 0
        fp32_output = tokens * vocab * FP32_BYTES  # eager's log_softmax output, part of `loss_saved`
        kept = relabel("compiled loss: logits and log-sum-exp kept for backward", acts.logits + tokens * FP32_BYTES)
        grad = relabel("compiled loss: the logits' gradient", acts.logits)
        head = grad + tokens * resid * spec.hidden_size  # and the gradient of the head's input
        if resid != act_bytes and not spec.tie_word_embeddings:
            # Under autocast the head's backward (its mm, then the cast of its weight) holds the 16-bit gradient of
            # the weight beside its fp32 cast (the .grad the engine counts) while the logits' and the input's 16-bit
            # gradients are alive: a moment eager's two fp32 loss gradients hid and the compiled loss's one shows
            head = grad + tokens * act_bytes * spec.hidden_size + relabel(
                "head weight's 16-bit gradient (autocast)", spec.vocab_size * spec.hidden_size * act_bytes)
        changes.update(logits=0, loss_saved=acts.loss_saved - fp32_output + kept, loss_transient=acts.loss_transient - upcast,
                       logits_grad=grad, logits_grad_cast=0, head_backward_temporary=head)
    return changes


def _unchanged_block_bytes(acts, spec: TransformerSpec, tokens: int, resid: int, act_bytes: int) -> int:
    """What eager's `saved_per_block` holds beyond its per-token tensors and compile keeps too: autocast's 16-bit
    weight casts, saved by the matmuls as the compiled graph saves them."""
    return 0 if resid == act_bytes else act_bytes * _block_matmul_weights(spec)


def _block_matmul_weights(spec: TransformerSpec) -> int:
    """Elements of a block's matmul weights (estimate/model/layout.py, norms left out)."""
    return sum(t.numel for t in param_layout(spec).block if t.name.endswith("weight") and "norm" not in t.name)

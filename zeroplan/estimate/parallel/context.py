"""Context parallelism's ring attention as moments of a block, not as buffers held all phase long.

torch's ring (torch/distributed/tensor/experimental/_context_parallel/_attention.py, torch 2.13;
torchtitan 0.3.0 runs it for SDPA with its defaults: the head-tail load balancer and the all-gather
rotater) allocates its tensors inside the attention core, in forward and in backward, and frees them
when the core returns. They therefore raise the peak only where the core's moment is a block's peak:
the end of the last block's forward (`block_forward_transient`) and the core's backward in the block
in progress (`attention_backward_saved` / `attention_backward_temporary`, which the engine profiles
compare with the MLP's moment). One tensor outlives the core on every rank but the last of the ring:
its output, which the merger leaves laid out (batch, heads, sequence, dim), so the attention's
`.contiguous()` before o_proj copies it (`_SDPAMerger._merge_one` -> `_partial_update`'s cat).
Derivations, each checked against the ring on gloo at cp 2 and 4, fp32 and bf16: docs/engines/mesh.md,
"Context parallelism: the ring's moments".
"""

from __future__ import annotations

from typing import NamedTuple

from zeroplan.estimate.activations.transformer import FP32_BYTES, ActivationBytes
from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.training import Checkpointing, TrainingSpec


class RingBytes(NamedTuple):
    """What the ring allocates on its worst rank, one block's core, beyond its inputs."""

    forward: int  # at the forward's peak (the last merge), beyond the output and log-sum-exp it returns
    backward: int  # at the backward's peak (the op's gradients returned at step 1), its result not yet cast
    output_copy: int  # the attention output's contiguous copy kept by o_proj (every rank but the ring's last)


def ring_bytes(model: TransformerSpec, cp: int, tp: int, tokens: int, act_bytes: int) -> RingBytes:
    """`tokens` = micro_batch x seq_len / cp on one rank; q, k, v of heads / tp (docs/engines/mesh.md)."""
    q = tokens * model.num_heads * model.dim_per_head // tp * act_bytes  # q, the output, their gradients
    kv = 2 * tokens * model.kv_heads * model.dim_per_head // tp * act_bytes  # k and v together
    q32, kv32 = q * FP32_BYTES // act_bytes, kv * FP32_BYTES // act_bytes  # fp32 accumulators (convert_to_f32)
    lse = tokens * model.num_heads // tp * FP32_BYTES
    # forward, the last merge of a full step (beyond the returned output and lse): docs/engines/mesh.md
    forward = cp * kv + 3 * q32 + (q32 if act_bytes != FP32_BYTES else 0) + 2 * lse
    # backward, step 1 (docs/engines/mesh.md): grad_query, dk/dv three times, cp + 1 k, v, two steps' gradients
    step0 = q + kv
    step1 = max(q + kv // 2, q // 2 + kv + lse // 2)
    second_send = 2 * kv if cp > 2 else 0
    backward = q32 + 3 * kv32 + (cp + 1) * kv + step0 + max(step1, second_send)
    return RingBytes(forward, backward, q)


def core_saved_bytes(local: TransformerSpec, training: TrainingSpec, tokens: int, act_bytes: int, norm_cut: int) -> int:
    """What the block in progress holds when its attention core's backward runs: the attention norm's
    tensors and the core's saved q, k, v, output and log-sum-exp (the MLP's, the second norm's and
    o_proj's input were freed by their backward before); `local` is the rank's view (heads / tp),
    `norm_cut` what sequence parallelism takes off one norm. Under full checkpointing they are the
    recomputed ones, beside the block input the checkpoint keeps (counted already)."""
    import zeroplan.estimate.activations.transformer as a

    w = a.Widths(resid=act_bytes, comp=act_bytes, autocast=False)  # torchtitan: no autocast (FSDP2 casts)
    core = a.attention_core(local, training.attention, a.dropout_of(local, training), w)
    attn_reads, _ = a.input_projections(local)
    checkpointing = Checkpointing.NONE if training.checkpointing == Checkpointing.FULL else training.checkpointing
    per_token = (a.norm_saved_per_token(local, w, attn_reads)
                 + a.attention_saved_per_token(local, core, checkpointing, training.seq_len, w))
    return tokens * per_token - norm_cut


def with_ring_attention(acts: ActivationBytes, model: TransformerSpec, training: TrainingSpec, tokens: int,
                        act_bytes: int, core_saved: int) -> ActivationBytes:
    """`acts` of one context-parallel rank with the ring's moments (the worst rank of the ring).
    `core_saved`: what the block in progress still holds when its attention core's backward runs."""
    mesh = training.mesh
    ring = ring_bytes(model, mesh.cp, mesh.tp, tokens, act_bytes)
    q_grad = ring.output_copy  # the attention output's gradient, o_proj's backward result (q width)
    changes: dict[str, int] = {}
    checkpointing = training.checkpointing
    if checkpointing in (Checkpointing.NONE, Checkpointing.OP):
        changes["saved_per_block"] = acts.saved_per_block + ring.output_copy
    elif checkpointing == Checkpointing.FULL:  # rebuilt with the block in its backward
        changes["recompute_block"] = acts.recompute_block + ring.output_copy
    # (selective: the core runs under checkpoint; o_proj keeps the copy and the merged output is freed)
    # the last block's ring: the blocks before it and its own attention norm, q, k, v (output and lse being merged);
    # `blocks_end_peak` counts the whole last block's saved tensors, which a checkpointed block does not save
    last_block = acts.saved_per_block if checkpointing == Checkpointing.NONE else 0
    changes["block_forward_transient"] = max(acts.block_forward_transient, core_saved + ring.forward - last_block)
    # the core's backward: the residual's gradient (kept until the residual add) and the output's, then the ring
    changes["attention_backward_saved"] = acts.attention_backward_saved + core_saved
    changes["attention_backward_temporary"] = (acts.attention_backward_temporary + acts.block_input_grad_bytes
                                               + q_grad + ring.backward)
    return acts.replaced(**changes)

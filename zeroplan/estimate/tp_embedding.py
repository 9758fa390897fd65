"""The whole embedding gradient of a rowwise-sharded embedding under tensor parallelism (issue 14).

torch 2.13.0 torch/distributed/tensor/_ops/_embedding_ops.py: `embedding_dense_backward_strategy`
offers colwise (Shard(1)), batch-dim (Partial) and Partial strategies, and the single-dim strategy
registration adds the all-Replicate one. Under torchtitan's RowwiseParallel embedding the output
gradient arrives Replicate (the backward of its output redistribution) and the token ids are
Replicate, so the all-Replicate strategy costs no redistribution and is chosen: the weight's
gradient is a Replicate DTensor of the whole (vocab, hidden) on every TP rank, not the Shard(0)
(vocab / tp, hidden) of its parameter (traced in docs/measure.md, "Embedding gradient under TP").
It stays whole as `.grad` until zero_grad when FSDP2 is off; FSDP2 redistributes it to the
parameter's placement before its reduce-scatter (fsdp/_fully_shard/_fsdp_param.py), so there it is
a transient of the embedding unit's post-backward, not modelled.
"""

from __future__ import annotations

from zeroplan.estimate.engines.common import ceil_div
from zeroplan.estimate.result import PhaseBytes
from zeroplan.estimate.terms import named, register

register({"replicated embedding gradient (TP)": "torch/distributed/tensor/_ops (the rowwise embedding's backward takes "
                                                "the all-Replicate strategy; docs/engines/mesh.md)"})
from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.mesh import MeshSpec


def replicated_embedding_grad_bytes(model: TransformerSpec, mesh: MeshSpec, grad_bytes: int) -> int:
    """What the whole gradient holds beyond the rank's vocabulary rows: (vocab - ceil(vocab / tp)) x hidden."""
    if mesh.tp == 1 or model.tie_word_embeddings:
        return 0  # a tied embedding's gradient meets the colwise head's: not this rule alone
    return named("replicated embedding gradient (TP)",
                 (model.vocab_size - ceil_div(model.vocab_size, mesh.tp)) * model.hidden_size * grad_bytes)


def with_replicated_embedding_grad(phases: tuple[PhaseBytes, ...], extra_bytes: int,
                                   all_grads_bytes: int) -> tuple[PhaseBytes, ...]:
    """The extra bytes in every phase whose peak holds every gradient: the embedding's is the last the
    backward writes, so such a moment holds it whole."""
    if not extra_bytes:
        return phases
    return tuple(PhaseBytes(p.step, p.phase, p.categories._replace(grads=p.categories.grads + extra_bytes))
                 if p.categories.grads >= all_grads_bytes > 0 else p for p in phases)

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

from dataclasses import replace

from zeroplan.estimate.engines.common import ceil_div
from zeroplan.estimate.model.facts import ModelFacts
from zeroplan.spec.mesh import MeshSpec
from zeroplan.spec.model import TransformerSpec


def with_replicated_embedding_grad(facts: ModelFacts, model: TransformerSpec, mesh: MeshSpec) -> ModelFacts:
    """`facts` of a rank that holds the rowwise embedding without FSDP2, its gradient whole: (vocab - ceil(vocab /
    tp)) x hidden elements beyond its parameter's rows, a .grad from the embedding's backward (the last) on."""
    if mesh.tp == 1 or model.tie_word_embeddings:
        return facts  # a tied embedding's gradient meets the colwise head's: not this rule alone
    return replace(facts, replicated_grad_params=(model.vocab_size - ceil_div(model.vocab_size, mesh.tp))
                   * model.hidden_size)

"""DeepSpeed's mesh (issue 14): what AutoTP training and Ulysses change in a rank's bytes, beside
torchtitan's plan that estimate/parallel/mesh.py models. Derivations: docs/engines/deepspeed.md, "AutoTP and Ulysses".

AutoTP (deepspeed 0.19.8, runtime/engine.py `_apply_autotp_partitioning`) follows the Hugging Face
model's tp_plan: for Llama `base_model_tp_plan` (q/k/v and gate/up "colwise", o and down "rowwise")
and `_tp_plan` ("lm_head": "colwise_gather_output"), turned into LinearLayer and LinearAllreduce
(module_inject/layers.py) by `TPPlanConverter`. So, unlike torchtitan's plan:
- the embedding is not in the plan and stays whole on every TP rank (an untied head; a tied head
  is not measured here and keeps torchtitan's layout);
- there is no sequence parallelism: the norms and the residual stream are whole on every TP rank;
- the head's output is all-gathered over the vocabulary (LinearLayer `gather_output`), so the logits
  and the loss are whole: no loss parallelism.
ZeRO 1-2 then partitions what each rank holds over its data-parallel group only (engine.py
`seq_data_parallel_group`: world / tp; with Ulysses the sequence ranks join it), as MeshSpec.fsdp_degree.
"""

from __future__ import annotations

from dataclasses import replace

from zeroplan.estimate.model.facts import ModelFacts, ModuleGroup
from zeroplan.estimate.model.layout import param_layout
from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.training import TrainingSpec


def autotp_training(training: TrainingSpec) -> TrainingSpec:
    """`training` as AutoTP runs it: no sequence parallelism, whole logits (module docstring)."""
    mesh = training.mesh
    if not (mesh.sequence_parallel or mesh.loss_parallel):
        return training
    return training.model_copy(update={"mesh": mesh.model_copy(update={"sequence_parallel": False, "loss_parallel": False})})


def autotp_facts(model: TransformerSpec, facts: ModelFacts) -> ModelFacts:
    """`facts` with the embedding whole: Llama's tp_plan does not name embed_tokens (module docstring)."""
    if model.tie_word_embeddings:  # not measured (engine.py `has_tied_vocab_head` may vocab-shard both): as torchtitan
        return facts
    whole = param_layout(model).embedding
    groups = tuple(ModuleGroup(g.role, whole, g.count, g.frozen, sum(t.numel for t in whole)) if g.role == "embedding"
                   else g for g in facts.groups)
    total = sum(g.params * g.count for g in groups)
    trainable = sum(g.params * g.count for g in groups if not g.frozen)
    return replace(facts, groups=groups, total_params=total, trainable_params=trainable,
                   largest_group_params=max(g.params for g in groups),
                   largest_tensor_numel=max(t.numel for g in groups for t in g.tensors))

"""What the engines need to know about a model, derived once from its spec.

Engines see parameter counts and module groups, not the spec: a `ParamCountSpec` (count only)
becomes one group of `largest_layer_params` repeated, and has no activation model.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.architecture import ParamLayout, ParamTensor, param_layout
from zeroplan.spec.model import ParamCountSpec, TransformerSpec
from zeroplan.spec.training import TrainingSpec


@dataclass(frozen=True)
class ModelFacts:
    name: str
    total_params: int
    trainable_params: int
    groups: tuple[tuple[ParamTensor, ...], ...]  # module groups in forward order (FSDP units, ZeRO-3 fetch order)
    frozen_groups: tuple[bool, ...]  # per group: True when it does not train

    @property
    def largest_group_params(self) -> int:
        return max(sum(t.numel for t in g) for g in self.groups)

    @property
    def largest_tensor_numel(self) -> int:
        return max(t.numel for g in self.groups for t in g)

    @property
    def trainable_tensors(self) -> tuple[ParamTensor, ...]:
        return tuple(t for g, frozen in zip(self.groups, self.frozen_groups) if not frozen for t in g)


def _transformer_facts(spec: TransformerSpec, training: TrainingSpec) -> ModelFacts:
    layout: ParamLayout = param_layout(spec)
    groups = (layout.embedding,) + (layout.block,) * layout.num_blocks + (layout.final,)
    kinds = ("embeddings",) + ("blocks",) * layout.num_blocks + ("final",)
    frozen = tuple(kind in training.freeze for kind in kinds)
    trainable = sum(sum(t.numel for t in g) for g, f in zip(groups, frozen) if not f)
    return ModelFacts(spec.name, layout.total_params, trainable, groups, frozen)


def _count_facts(spec: ParamCountSpec) -> ModelFacts:
    # Without a layout, split the count into layers of `largest_layer_params` (DeepSpeed's
    # estimate_zero3_model_states_mem_needs takes the same two numbers).
    largest = spec.largest_layer_params or spec.params
    full_layers, rest = divmod(spec.params, largest)
    groups = tuple((ParamTensor("layer.weight", largest, largest),) for _ in range(full_layers))
    if rest:
        groups += ((ParamTensor("layer.weight", rest, rest),),)
    trainable = spec.params if spec.trainable_params is None else spec.trainable_params
    # Frozen parameters are taken from the end; only the total trainable count matters here.
    frozen = tuple(False for _ in groups)
    return ModelFacts(spec.name, spec.params, trainable, groups, frozen)


def model_facts(spec: TransformerSpec | ParamCountSpec, training: TrainingSpec) -> ModelFacts:
    if isinstance(spec, TransformerSpec):
        return _transformer_facts(spec, training)
    return _count_facts(spec)

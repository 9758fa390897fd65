"""What the engines need to know about a model, derived once from its spec (and cached: the
planner asks for the same model thousands of times).

Parameters are grouped into the module groups ZeRO-3 and FSDP2 gather one at a time: the
embeddings, each transformer block, and the final norm with the output head. Identical blocks are
one `ModuleGroup` with a count, so engines sum over three groups, not over every tensor.
A `ParamCountSpec` (count only) becomes layers of `largest_layer_params` and has no activations.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import zeroplan.estimate.activations.moe as moe
from zeroplan.errors import SpecError
from zeroplan.estimate.caches import memo
from zeroplan.estimate.model.layout import ParamTensor, param_layout
from zeroplan.estimate.adapters.lora import (PackedStorage, is_saved_copy, lora_layout, packed_layout, packed_storage,
                                            saved_copy_element)
from zeroplan.spec.lora import LoraSpec
from zeroplan.spec.model import ParamCountSpec, TransformerSpec
from zeroplan.spec.training import TrainingSpec


class ModuleGroup(NamedTuple):
    role: str  # "embedding", "block", "final" (FSDP2's root unit is embedding + final)
    tensors: tuple[ParamTensor, ...]
    count: int  # identical copies of this group (the transformer blocks)
    frozen: bool  # does not train: no gradients, no optimizer states
    params: int  # elements in one copy

    @property
    def trainable_tensors(self) -> tuple[ParamTensor, ...]:
        """The tensors that train (all of a group that trains, but LoRA's frozen base tensors)."""
        return () if self.frozen else tuple([t for t in self.tensors if not t.frozen])

    @property
    def trainable_params(self) -> int:
        """Elements that train in one copy."""
        return sum(t.numel for t in self.trainable_tensors)


# eq=False: hashed and compared by identity. The engines' caches are keyed by ModelFacts, and
# `model_facts` returns the same object for the same spec; a field-by-field hash walks every tensor
# of every group (several microseconds, more than the rest of some estimates).
@dataclass(frozen=True, eq=False)
class ModelFacts:
    name: str
    total_params: int
    trainable_params: int
    groups: tuple[ModuleGroup, ...]  # in forward order
    largest_group_params: int
    largest_tensor_numel: int
    # a sparse MLP's gradients alive at its backward peak, in place of `early_gradients`' rule (estimate/activations/moe.py)
    first_block_gradient: int | None = None
    # gradient elements beyond the parameters': a gradient whole where its parameter is a shard (a TP rowwise
    # embedding without FSDP2, estimate/parallel/tp_embedding.py); it arrives with the embedding's, the last
    replicated_grad_params: int = 0

    def trainable_numels(self) -> list[int]:
        """Every trainable tensor's element count, in `model.parameters()` order (block after block)."""
        return [t.numel for g in self.groups for _ in range(g.count) for t in g.trainable_tensors]


def _group(role: str, tensors: tuple[ParamTensor, ...], count: int, frozen: bool) -> ModuleGroup:
    frozen = frozen or all(t.frozen for t in tensors)
    return ModuleGroup(role, tensors, count, frozen, sum(t.numel for t in tensors))


def _facts(name: str, groups: tuple[ModuleGroup, ...], trainable: int | None = None) -> ModelFacts:
    total = sum(g.params * g.count for g in groups)
    if trainable is None:
        trainable = sum(g.trainable_params * g.count for g in groups)
    largest_group = max(g.params for g in groups)
    largest_tensor = max(t.numel for g in groups for t in g.tensors)
    return ModelFacts(name, total, trainable, groups, largest_group, largest_tensor)


@memo(maxsize=256)  # one object per model: the engines' caches key by its identity (plans take 2-8x longer without it)
def _transformer_facts(spec: TransformerSpec, freeze: tuple[str, ...]) -> ModelFacts:
    layout = param_layout(spec)
    groups = (
        _group("embedding", layout.embedding, 1, "embeddings" in freeze),
        # one group per run of like blocks, in forward order (dense and sparse MLPs: estimate/model/moe_layout.py)
        *(_group("block", tensors, count, "blocks" in freeze) for tensors, count in layout.runs),
        _group("final", layout.final, 1, "final" in freeze),
    )
    facts = _facts(spec.name, groups)
    if spec.moe is not None:  # Qwen3-MoE, DeepSeek-V3, GPT-OSS
        facts = replace(facts, first_block_gradient=moe.first_block_gradient(spec))
    return facts


@memo(maxsize=256)  # one object per model, as `_transformer_facts`
def _lora_facts(spec: TransformerSpec, lora: LoraSpec, packed: PackedStorage | None = None,
                copy_element: int | None = None) -> ModelFacts:
    """The model with PEFT's adapters: base tensors frozen, adapters trained (estimate/adapters/lora.py); with
    `packed`, the 4-bit weights as the storage a sharding engine gathers (the parameter count stays); with
    `copy_element`, modules_to_save copies in the base's dtype (`saved_copy_element`)."""
    layout = lora_layout(spec, lora)
    if packed is not None:
        return replace(_lora_facts(spec, lora), groups=_lora_facts_of(spec, packed_layout(spec, layout, packed)).groups)
    return _lora_facts_of(spec, layout, copy_element)


def _lora_facts_of(spec: TransformerSpec, layout, copy_element: int | None = None) -> ModelFacts:
    def kept(tensors: tuple[ParamTensor, ...]) -> tuple[ParamTensor, ...]:
        if copy_element is None:
            return tensors
        return tuple([t._replace(element=copy_element) if is_saved_copy(t) else t for t in tensors])

    groups = [_group("embedding", kept(layout.embedding), 1, False)]
    groups += [_group("block", kept(tensors), count, False) for tensors, count in layout.runs]  # per block kind
    groups.append(_group("final", kept(layout.final), 1, False))
    return _facts(spec.name, tuple(groups))


@memo(maxsize=256)  # one object per model, as `_transformer_facts`
def _count_facts(spec: ParamCountSpec) -> ModelFacts:
    # Without a layout, split the count into layers of `largest_layer_params` (DeepSpeed's
    # estimate_zero3_model_states_mem_needs takes the same two numbers).
    largest = spec.largest_layer_params or spec.params
    full_layers, rest = divmod(spec.params, largest)
    groups = (_group("block", (ParamTensor("layer.weight", largest, largest, role="layer"),), full_layers, False),)
    if rest:
        groups += (_group("block", (ParamTensor("layer.weight", rest, rest, role="layer"),), 1, False),)
    trainable = spec.params if spec.trainable_params is None else spec.trainable_params
    return _facts(spec.name, groups, trainable)


def _gathers_layers(training: TrainingSpec) -> bool:
    """Engines whose peak holds the largest gathered layer: FSDP2 (any stage), FSDP1 (sharded), DeepSpeed ZeRO-3."""
    engine = training.engine.value
    return (engine == "fsdp2" or (engine == "deepspeed" and training.zero_stage == 3)
            or (engine == "fsdp1" and training.zero_stage != 0))


def _gathering_engine(training: TrainingSpec) -> str:
    return {"fsdp2": "FSDP2", "fsdp1": "FSDP1"}.get(training.engine.value, "DeepSpeed ZeRO-3")


def model_facts(spec: TransformerSpec | ParamCountSpec, training: TrainingSpec) -> ModelFacts:
    if isinstance(spec, ParamCountSpec) and spec.largest_layer_params is None and _gathers_layers(training):
        # Taking the whole model as one layer would gather all of it at once (45 GiB instead of
        # 5.4 GiB for 7.5e9 parameters at ZeRO-3 on 64 GPUs); DeepSpeed's own estimator asks for it too.
        raise SpecError(
            "largest_layer_params: a model known by its parameter count needs its largest layer (--largest-layer) "
            f"under {_gathering_engine(training)}, which gathers one layer at a time"
        )
    freeze = tuple(sorted(training.freeze)) if training.freeze else ()
    if training.lora is not None and isinstance(spec, TransformerSpec):
        return _lora_facts(spec, training.lora, packed_storage(training), saved_copy_element(training))
    return _transformer_facts(spec, freeze) if isinstance(spec, TransformerSpec) else _count_facts(spec)

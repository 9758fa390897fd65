"""The analytic memory model: `estimate(model, training) -> Estimate`, standard library only
(`fit(model, training)` gives its peak alone, faster, for the planner).

Each engine profile (zeroplan/estimate/engines/) models what its implementation allocates, per
phase of the first and of a steady-state step; activations (activations.py) and per-element
sizes (dtypes.py) are shared. The peak is the largest phase, not a sum of maxima.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any, NamedTuple

from zeroplan.estimate import caches
from zeroplan.estimate.activations import activation_bytes, attention_kernel, memory_checkpointing
from zeroplan.estimate.dtypes import state_bytes
from zeroplan.estimate.engines.common import EngineEstimate, setup_of
from zeroplan.estimate.lora import kbit_activation_bytes, lora_activations
from zeroplan.estimate.facts import ModelFacts, model_facts
from zeroplan.estimate.ledger import fold
from zeroplan.estimate.overhead import overhead_bytes
from zeroplan.estimate.result import Estimate, ModelSummary, NodeBytes, ParamParts, PhaseBytes
from zeroplan.estimate.terms import naming
from zeroplan.spec.model import ModelSpec, TransformerSpec
from zeroplan.spec.training import Attention, Device, Engine, TrainingSpec
from zeroplan.spec.training import clear_caches as clear_resolved_programs

IMPLEMENTATION = "hf-transformers"  # the modules activations.py describes, with the model's dropout rates
# engine -> (module under zeroplan.estimate.engines, its profile function). A module is imported
# when its engine is first estimated: a command estimates one engine, and importing the others
# cost a tenth of `zeroplan estimate`'s start-up (bench/results/estimate_speed.md).
_PROFILES = {Engine.DEEPSPEED: ("deepspeed", "estimate_deepspeed"), Engine.FSDP2: ("fsdp2", "estimate_fsdp2"),
             Engine.TORCH: ("torch_ddp", "estimate_torch"), Engine.PAPER: ("paper", "estimate_paper")}
_LOADED: dict[Engine, Any] = {}


def _engine_profile(engine: Engine) -> Any:
    profile = _LOADED.get(engine)
    if profile is None:
        module, function = _PROFILES[engine]
        profile = _LOADED[engine] = getattr(import_module(f"zeroplan.estimate.engines.{module}"), function)
    return profile
_IMPLEMENTATIONS = {attention: f"{IMPLEMENTATION}/{attention.value}" for attention in Attention}


def _with_overhead(phases: tuple[PhaseBytes, ...], overhead: int) -> tuple[PhaseBytes, ...]:
    if not overhead:
        return phases
    return tuple([PhaseBytes(p.step, p.phase, p.categories.with_overhead(overhead)) for p in phases])


class _Profiled(NamedTuple):
    facts: ModelFacts
    implementation: str  # which model implementation the activation terms describe
    result: EngineEstimate
    overhead: int  # added to every phase of the result
    notes: tuple[str, ...]
    param_parts: ParamParts | None = None  # with LoRA: the peak's params as base + adapter bytes


def _profile(model: ModelSpec, training: TrainingSpec) -> _Profiled:
    facts = model_facts(model, training)
    dtypes = state_bytes(training.precision, training.optimizer)
    acts = None
    notes: tuple[str, ...] = ()
    if isinstance(model, TransformerSpec):
        activation = kbit_activation_bytes(training, dtypes.activation)  # estimate/lora.py
        acts = activation_bytes(model, training, activation)
        if training.lora is not None:
            acts = lora_activations(acts, model, training, activation)  # estimate/lora.py
        implementation = _IMPLEMENTATIONS[training.attention]
        notes = _checkpointing_notes(model, training)
        if attention_kernel(model, training) == "math":
            notes += ("attention dropout on cpu: SDPA has no fused kernel with dropout there, so its math path "
                      "runs and keeps the attention matrices (fp32)",)
    else:
        implementation = "parameter count only"
        notes = ("model given by parameter count: activations are not estimated",)
    setup = setup_of(training)
    if training.engine == Engine.PAPER:
        result, overhead = _engine_profile(Engine.PAPER)(facts, setup, dtypes), 0
    else:
        result, overhead = _engine_profile(training.engine)(facts, setup, acts), overhead_bytes(training)
    parts = None
    if training.lora is not None and isinstance(model, TransformerSpec):
        result, parts, lora_notes = _with_lora(result, facts, model, training, dtypes.param)
        notes += lora_notes
    if acts is not None and acts.offloaded:
        result, offload_notes = _with_offloaded_activations(result, acts.host_bytes, training)
        notes += offload_notes
    return _Profiled(facts, implementation, result, overhead, notes + result.notes if result.notes else notes, parts)


def _with_lora(result: EngineEstimate, facts: ModelFacts, model: TransformerSpec, training: TrainingSpec,
               param: int) -> tuple[EngineEstimate, ParamParts, tuple[str, ...]]:
    """The engine's phases with the base stored as `training.quant` says and the dequantized (and DoRA)
    temporaries of the adapted layers (estimate/lora.py; docs/engines/lora.md)."""
    from zeroplan.estimate import lora
    from zeroplan.estimate.result import Step

    delta = lora.base_params_delta(model, training, param)
    copy_element = lora.saved_copy_element(training)
    copies = None
    if copy_element is not None:
        from zeroplan.estimate import lora_saved

        copies = lora_saved.saved_copy_bytes(facts, training, setup_of(training), copy_element)
    full_grads = max(p.categories.grads for p in result.phases)
    phases = []
    for p in result.phases:
        categories = p.categories._replace(params=max(0, p.categories.params + delta + _fp32_adapters(facts, training, param, p.step)))
        if copies is not None:
            categories = lora_saved.with_saved_copies(categories, p.phase, copies, full_grads)
        phases.append(PhaseBytes(p.step, p.phase, categories))
    result = result._replace(phases=tuple(phases))
    peak = max(result.phases, key=lambda p: p.total_bytes)
    adapter = min(peak.categories.params, lora.adapter_param_bytes(facts, training, param, peak.step == Step.STEADY)
                  + _fp32_adapters(facts, training, param, peak.step))
    return result, ParamParts(peak.categories.params - adapter, adapter), lora.lora_notes(model, training, facts)


def _fp32_adapters(facts: ModelFacts, training: TrainingSpec, param: int, step) -> int:
    """The Trainer's adapters kept fp32 under DeepSpeed ZeRO-3 (estimate/lora_trainer.py)."""
    from zeroplan.estimate import lora, lora_trainer
    from zeroplan.estimate.result import Step

    if not lora_trainer.adapters_stay_fp32(training):
        return 0
    return lora_trainer.adapter_params_delta(lora.adapter_param_bytes(facts, training, param, step == Step.STEADY), training)


def _with_offloaded_activations(result: EngineEstimate, host_bytes: int, training: TrainingSpec) -> tuple[EngineEstimate, tuple[str, ...]]:
    """Add the activations offloaded to the host (pinned: torchtune OffloadActivations(use_pin_memory=True))
    to the engine's per-node host bytes."""
    node = host_bytes * training.node_gpus
    cpu_run = training.device == Device.CPU
    per_node = result.per_node._replace(cpu_bytes=result.per_node.cpu_bytes + node,
                                        pinned_bytes=result.per_node.pinned_bytes + (0 if cpu_run else node))
    notes = ()
    if cpu_run:
        notes = (f"CPU run: the {host_bytes:,} bytes of activations offloaded per rank are host copies, counted apart "
                 "from the device as on GPUs (zeroplan measure counts them apart too)",)
    return result._replace(per_node=per_node), notes


def _checkpointing_notes(model: TransformerSpec, training: TrainingSpec) -> tuple[str, ...]:
    """Say so when the checkpointing asked for changes no byte (issue 11)."""
    if memory_checkpointing(training, model) != training.checkpointing:
        return ("checkpointing selective keeps what none keeps here: the fused attention kernel saves no attention "
                "scores for the recomputation to spare; op (torchtitan's per-op policy) or full keep less",)
    if training.checkpoint_every and training.checkpoint_every > model.num_layers:
        return (f"checkpoint_every {training.checkpoint_every} exceeds the {model.num_layers} blocks: no block is "
                "checkpointed",)
    return ()


def _estimate_of(profiled: _Profiled, engine: Engine) -> Estimate:
    facts = profiled.facts
    summary = ModelSummary(facts.name, facts.total_params, facts.trainable_params, profiled.implementation)
    folded = fold(_with_overhead(profiled.result.phases, profiled.overhead), profiled.result.per_node)
    parts = profiled.param_parts
    if parts is not None:
        parts = ParamParts(int(parts.base_bytes), int(parts.adapter_bytes))
    return Estimate(summary, engine.value, folded.phases, folded.per_node, profiled.notes, parts, folded.ledger)


def estimate(model: ModelSpec, training: TrainingSpec) -> Estimate:
    """Per-GPU memory by phase and category, and per-node host memory, for one configuration, with
    the terms each phase's bytes are made of (its ledger)."""
    with naming():
        return estimate_unnamed(model, training)


def estimate_unnamed(model: ModelSpec, training: TrainingSpec) -> Estimate:
    """`estimate(model, training)` in the current naming mode: without its ledger in the planner's fast
    mode (estimate/terms.py), the same bytes."""
    return _estimate_of(_profile(model, training), training.engine)


class Fit(NamedTuple):
    """What deciding whether a configuration fits needs: `estimate(...)`'s peak and host bytes;
    `.estimate()` builds the rest only when the configuration is shown."""

    peak_bytes: int
    per_node: NodeBytes
    profiled: _Profiled
    engine: Engine

    def estimate(self) -> Estimate:
        """What `estimate(model, training)` returns for this configuration."""
        return _estimate_of(self.profiled, self.engine)


def fit(model: ModelSpec, training: TrainingSpec) -> Fit:
    """`estimate(model, training)`'s peak and per-node bytes, equal to its (tests/test_plan.py),
    without building the per-phase result: the planner decides the fit of thousands of
    configurations and shows a handful (a quarter of an estimate's time goes into that result)."""
    profiled = _profile(model, training)
    peak = max([sum(p.categories) for p in profiled.result.phases]) + profiled.overhead
    return Fit(peak, profiled.result.per_node, profiled, training.engine)


def clear_caches() -> None:
    """Forget everything the estimator keeps between calls (model facts and layouts, activations,
    per-configuration sizes): the next estimate runs as the first of a process does. For
    benchmarks and tests; results never depend on it."""
    caches.clear_all()
    clear_resolved_programs()  # spec/training.py: the resolved programs and FSDP2 wrappings

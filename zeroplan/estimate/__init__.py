"""The analytic memory model: `estimate(model, training) -> Estimate`, standard library only.

Each engine profile (zeroplan/estimate/engines/) models what its implementation allocates, per
phase of the first and of a steady-state step; activations (activations.py) and per-element
sizes (dtypes.py) are shared. The peak is the largest phase, not a sum of maxima.
"""

from __future__ import annotations

from zeroplan.estimate.activations import activation_bytes
from zeroplan.estimate.dtypes import state_bytes
from zeroplan.estimate.engines.deepspeed import estimate_deepspeed
from zeroplan.estimate.engines.fsdp2 import estimate_fsdp2
from zeroplan.estimate.engines.paper import estimate_paper
from zeroplan.estimate.engines.torch_ddp import estimate_torch
from zeroplan.estimate.facts import model_facts
from zeroplan.estimate.overhead import overhead_bytes
from zeroplan.estimate.result import Estimate, ModelSummary, PhaseBytes
from zeroplan.spec.model import ModelSpec, TransformerSpec
from zeroplan.spec.training import Engine, TrainingSpec

IMPLEMENTATION = "hf-transformers"  # the modules activations.py describes, trained without dropout
_PROFILES = {Engine.DEEPSPEED: estimate_deepspeed, Engine.FSDP2: estimate_fsdp2, Engine.TORCH: estimate_torch}


def _with_overhead(phases: tuple[PhaseBytes, ...], overhead: int) -> tuple[PhaseBytes, ...]:
    if not overhead:
        return phases
    return tuple([PhaseBytes(p.step, p.phase, p.categories.with_overhead(overhead)) for p in phases])


def estimate(model: ModelSpec, training: TrainingSpec) -> Estimate:
    """Per-GPU memory by phase and category, and per-node host memory, for one configuration."""
    facts = model_facts(model, training)
    dtypes = state_bytes(training.precision, training.optimizer)
    acts = None
    notes: tuple[str, ...] = ()
    if isinstance(model, TransformerSpec):
        acts = activation_bytes(model, training, dtypes.activation)
        implementation = f"{IMPLEMENTATION}/{training.attention.value}"
    else:
        implementation = "parameter count only"
        notes = ("model given by parameter count: activations are not estimated",)
    if training.engine == Engine.PAPER:
        result = estimate_paper(facts, training, dtypes)
        phases = result.phases
    else:
        result = _PROFILES[training.engine](facts, training, acts)
        phases = _with_overhead(result.phases, overhead_bytes(training))
    summary = ModelSummary(facts.name, facts.total_params, facts.trainable_params, implementation)
    return Estimate(summary, training.engine.value, phases, result.per_node, notes + result.notes)

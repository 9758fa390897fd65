"""The analytic memory model, standard library only.

- `estimate(model, training) -> Estimate`: per-GPU bytes by phase and category, per-node host bytes, and
  the ledger of named terms they fold from; on a mesh, the rank kind with the highest peak.
- `estimate_mesh(model, training) -> MeshEstimate`: every rank kind (one on plain data parallelism).
- `fit(model, training)`: the peak alone, in the planner's fast mode (no names), for fit checks;
  `FitModel(model, training).at(micro_batch, grad_accum)` the same for many micro-batches of one configuration.
Every estimate goes through one pipeline (estimate/pipeline.py); the engines' profiles are in
estimate/engines/, the activations in activations.py, per-element sizes in dtypes.py.
"""

from __future__ import annotations

from typing import NamedTuple

from zeroplan.estimate import caches
from zeroplan.estimate.pipeline import (IMPLEMENTATION, SingleRank, estimate_mesh, estimate_mesh_unnamed, estimate_mesh_within,
                                        estimate_of, middle_ranks_peak_bound, profile_rank, rank_estimate, rank_params,
                                        single_kind, single_peak, single_rank, worst_rank_estimate)
from zeroplan.estimate.result import Estimate, NodeBytes
from zeroplan.spec.model import ModelSpec
from zeroplan.spec.training import TrainingSpec
from zeroplan.spec.training import clear_caches as clear_resolved_programs

__all__ = ["IMPLEMENTATION", "Estimate", "Fit", "FitModel", "clear_caches", "estimate", "estimate_mesh", "estimate_mesh_unnamed",
           "estimate_mesh_within", "fit", "middle_ranks_peak_bound", "rank_estimate", "rank_params", "worst_rank_estimate"]


def estimate(model: ModelSpec, training: TrainingSpec) -> Estimate:
    """Per-GPU memory by phase and category, and per-node host memory, for one configuration, with the terms
    each phase's bytes are made of (its ledger); on a mesh, the estimate of the rank that peaks highest."""
    return estimate_mesh(model, training).worst.estimate


class Fit(NamedTuple):
    """What deciding whether a configuration fits needs: `estimate(...)`'s peak and host bytes;
    `.estimate()` builds the rest only when the configuration is shown."""

    peak_bytes: int
    per_node: NodeBytes
    model: ModelSpec
    training: TrainingSpec

    def estimate(self) -> Estimate:
        """What `estimate(model, training)` returns for this configuration, without its ledger."""
        return estimate_of(self.model, self.training, profile_rank(self.model, self.training, single_kind(self.model), 1))


def fit(model: ModelSpec, training: TrainingSpec) -> Fit:
    """`estimate(model, training)`'s peak and per-node bytes on plain data parallelism, equal to its
    (tests/plan/test_search.py), in the planner's fast mode: no names, no notes, no per-phase result. The planner
    decides the fit of thousands of configurations and shows a handful."""
    if not training.mesh.is_trivial:  # (the planner checks meshes rank by rank: plan/mesh_fit.py)
        profile = profile_rank(model, training, single_kind(model), 1)
        return Fit(max([sum(p.categories) for p in profile.phases]), profile.per_node, model, training)
    return Fit(*single_peak(model, training, single_rank(model, training)), model, training)


class FitModel:
    """`fit` of one plain data-parallel configuration as a function of the micro-batch and accumulation (`at`),
    what neither changes (the model's facts, what the activations read of the spec, the engine's set-up, the overhead:
    `SingleRank`) computed once, as plan/step_time.py `StepModel` does for the step time."""

    def __init__(self, model: ModelSpec, training: TrainingSpec):
        if not training.mesh.is_trivial:
            raise ValueError("FitModel: a mesh is checked rank by rank (zeroplan.estimate.rank_estimate)")
        self.model, self.training = model, training
        self._ranks: dict[bool, SingleRank] = {}  # by whether gradients accumulate (the set-up's only difference)

    def at(self, micro_batch: int, grad_accum: int) -> Fit:
        """`fit(model, training)` with `micro_batch` sequences per micro-batch and `grad_accum` micro-batches."""
        if micro_batch < 1 or grad_accum < 1:
            raise ValueError(f"FitModel.at: micro_batch and grad_accum must be at least 1, got {micro_batch}, {grad_accum}")
        # as the planner's specs (plan/search.py `Planner.training`), a copy: the spec's validators are not run again
        training = self.training.model_copy(update={"micro_batch": micro_batch, "grad_accum": grad_accum})
        rank = self._ranks.get(grad_accum > 1)
        if rank is None:
            rank = self._ranks[grad_accum > 1] = single_rank(self.model, training)
        return Fit(*single_peak(self.model, training, rank), self.model, training)


def clear_caches() -> None:
    """Forget everything the estimator keeps between calls (model facts and layouts, activations,
    per-configuration sizes): the next estimate runs as the first of a process does. For
    benchmarks and tests; results never depend on it."""
    caches.clear_all()
    clear_resolved_programs()  # spec/training.py: the resolved programs and FSDP2 wrappings

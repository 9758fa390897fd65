"""The mesh search's shortcuts (issue 14's "answers in under a second") change no plan: a mesh the world rule
refuses is skipped, a selective fit check is its twin's without checkpointing where the two keep the same, a fit
check stops at the first rank over the budget and leaves out the pipeline ranks no higher than rank 1
(`may_be_worst`). The search without them (every rank estimated, fresh caches) gives the same plan and the same
reasons. The cost bound (`Planner.search` with `top`) leaves out the choices that could not be shown: the same
plan, fewer choices checked, and it says so."""

from __future__ import annotations

import pytest

import zeroplan.plan.search as search_module
from zeroplan.estimate import clear_caches
from zeroplan.estimate import estimate_mesh, estimate_mesh_within
from zeroplan.importers.catalog import resolve_model
from zeroplan.importers.gpus import get_gpu
from zeroplan.plan.mesh_fit import estimate_groups, may_be_worst, memory_twin
from zeroplan.plan.rates import rates_for
from zeroplan.plan.search import Limits, SearchSpace, plan
from zeroplan.plan.serialize import plan_to_dict
from zeroplan.report.plan import render_plan
from zeroplan.spec.mesh import MeshSpec, PPSchedule
from zeroplan.spec.training import TrainingSpec

H100 = get_gpu("h100-80gb")


def _without_shortcuts(monkeypatch) -> None:
    """The search as first written: every rank of every mesh estimated, no world rule applied before validation,
    no fit check shared between memory twins."""

    def full_estimate(model, training, budget_bytes):
        whole = estimate_mesh(model, training)
        return whole.worst if whole.worst.estimate.peak_bytes <= budget_bytes else None

    def unshared(self, choice, micro_batch, grad_accum, budget_bytes):  # each choice its own check, none cached
        try:
            worst = full_estimate(self.model, self.training(choice, micro_batch, grad_accum), budget_bytes)
        except search_module.SpecError:
            return None
        return None if worst is None else worst.estimate.peak_bytes

    monkeypatch.setattr(search_module, "world_runs", lambda mesh, gpus, base, stage: True)
    monkeypatch.setattr(search_module.Planner, "mesh_peak", unshared)


def _plan(model, base, budget_bytes, top, cost_bound=True):
    space = SearchSpace(gpu_counts=(base.gpus,), mesh="search", max_micro_batch=8)
    return plan_to_dict(plan(model, base, space, Limits(budget_bytes, headroom=0.0), rates_for(H100), top=top,
                             cost_bound=cost_bound))


@pytest.mark.parametrize("recipe, gpus, seq_len, budget_gib", [
    ("torchtitan", 16, 4096, 76),  # pipelines allowed: most ranks estimated lazily
    ("torchtitan", 16, 4096, 30),  # a tight budget: fit checks stop early, many meshes do not fit
    ("hf-trainer", 32, 8192, 76),  # the Trainer runs no pipeline: those meshes are skipped by the world rule
    ("torchtitan", 64, 8192, 50),  # selective checkpointing's fit checks shared with none's (cp 1)
])
def test_the_search_with_its_shortcuts_gives_the_plan_of_the_full_search(monkeypatch, recipe, gpus, seq_len,
                                                                         budget_gib):
    model = resolve_model("llama-3-8b")
    base = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=gpus, seq_len=seq_len, recipe=recipe)
    budget = budget_gib * 2**30

    def search():
        clear_caches()
        found = _plan(model, base, budget, 8, cost_bound=False)
        del found["estimate_calls"], found["notes"]  # the twins' counted note goes with the shortcut
        return found

    fast = search()
    with monkeypatch.context() as patch:
        _without_shortcuts(patch)
        full = search()
    assert fast == full and fast["top"]


@pytest.mark.parametrize("mesh", [
    MeshSpec(pp=4),
    MeshSpec(pp=4, pp_schedule=PPSchedule.INTERLEAVED_1F1B, pp_virtual_stages=2),
    MeshSpec(tp=2, cp=2),
    MeshSpec(tp=2, pp=2),
])
def test_a_fit_check_is_the_full_estimate_when_it_fits_and_none_when_a_rank_is_over(mesh):
    model = resolve_model("llama-3-8b")
    training = TrainingSpec(engine="fsdp2", zero_stage=2, gpus=16, seq_len=4096, recipe="torchtitan",
                            micro_batch=2, grad_accum=8, mesh=mesh)
    whole = estimate_mesh(model, training)
    peaks = sorted({rank.estimate.peak_bytes for rank in whole.ranks})
    for budget in (peaks[-1], peaks[-1] - 1, peaks[0] - 1, peaks[0]):
        within = estimate_mesh_within(model, training, budget)
        if peaks[-1] <= budget:
            assert within is not None and within.ranks == whole.ranks
        else:
            assert within is None


@pytest.mark.parametrize("schedule", [PPSchedule.ONE_F_ONE_B, PPSchedule.GPIPE])
@pytest.mark.parametrize("pp, layers", [(4, 32), (8, 80), (16, 80), (8, 126)])
def test_no_middle_pipeline_rank_left_out_is_higher_than_rank_1(schedule, pp, layers):
    # `_may_be_worst`'s argument: a one-stage middle rank with no more layers or micro-batches in flight than
    # rank 1 has no higher peak; every rank is estimated here to check it
    model = resolve_model("llama-3-70b").model_copy(update={"num_layers": layers})
    training = TrainingSpec(engine="fsdp2", zero_stage=2, gpus=8 * pp, seq_len=4096, recipe="torchtitan",
                            micro_batch=2, grad_accum=2 * pp, mesh=MeshSpec(tp=8, pp=pp, pp_schedule=schedule))
    whole = estimate_mesh(model, training)
    kept = may_be_worst([rank.kind for rank in whole.ranks])
    assert len(kept) == 3
    left_out = [rank.estimate.peak_bytes for index, rank in enumerate(whole.ranks) if index not in kept]
    assert max(left_out) <= whole.ranks[1].estimate.peak_bytes
    assert whole.worst in [whole.ranks[index] for index in kept]


@pytest.mark.parametrize("pp, layers, checkpointing, cp", [
    (4, 30, "none", 1), (8, 80, "full", 1), (16, 80, "full", 2), (8, 126, "none", 2), (16, 126, "selective", 1),
])
def test_one_walk_bounds_every_middle_rank_of_an_interleaved_schedule(pp, layers, checkpointing, cp):
    # `middle_ranks_peak_bound` (docs/engines/mesh.md, "One walk for the middle ranks"): no middle rank it
    # bounds is above it; every rank is estimated here to check it
    from zeroplan.estimate import middle_ranks_peak_bound

    model = resolve_model("llama-3-70b").model_copy(update={"num_layers": layers})
    training = TrainingSpec(engine="fsdp2", zero_stage=2, gpus=8 * pp * cp, seq_len=8192, recipe="torchtitan",
                            micro_batch=1, grad_accum=2 * pp, checkpointing=checkpointing,
                            mesh=MeshSpec(tp=4, cp=cp, pp=pp, pp_schedule=PPSchedule.INTERLEAVED_1F1B, pp_virtual_stages=2))
    whole = estimate_mesh(model, training)
    groups = estimate_groups([rank.kind for rank in whole.ranks], list(range(len(whole.ranks))))
    bounded = [group for group in groups if len(group) > 1]
    assert bounded  # the middle ranks share profiles
    for group in bounded:
        bound = middle_ranks_peak_bound(model, training, tuple(whole.ranks[index].kind for index in group))
        assert bound is not None
        assert max(whole.ranks[index].estimate.peak_bytes for index in group) <= bound


def test_no_bound_where_the_argument_does_not_hold():
    from zeroplan.estimate import middle_ranks_peak_bound

    model = resolve_model("llama-3-8b")
    for mesh in (MeshSpec(pp=4, pp_schedule=PPSchedule.ZERO_BUBBLE, pp_virtual_stages=2), MeshSpec(pp=4)):
        training = TrainingSpec(engine="fsdp2", zero_stage=2, gpus=16, seq_len=4096, recipe="torchtitan", micro_batch=1,
                                grad_accum=8, mesh=mesh)
        kinds = [rank.kind for rank in estimate_mesh(model, training).ranks]
        assert middle_ranks_peak_bound(model, training, tuple(kinds[1:-1])) is None
        assert middle_ranks_peak_bound(model, training, tuple(kinds[:2])) is None  # rank 0 holds the embedding


@pytest.mark.parametrize("mesh", [
    MeshSpec(tp=2), MeshSpec(tp=2, sequence_parallel=False), MeshSpec(pp=4), MeshSpec(tp=2, pp=2, dp_replicate=2),
    MeshSpec(pp=4, pp_schedule=PPSchedule.INTERLEAVED_1F1B, pp_virtual_stages=2),
])
def test_selective_checkpointing_keeps_what_none_keeps_on_every_rank_without_a_ring(mesh):
    # `_memory_twin`: under fused attention selective checkpointing's mesh estimate is none's, rank by rank
    model = resolve_model("llama-3-8b")
    training = TrainingSpec(engine="fsdp2", zero_stage=2, gpus=16, seq_len=4096, recipe="torchtitan", micro_batch=2,
                            grad_accum=8, mesh=mesh, checkpointing="selective")
    twin = memory_twin(model, training)
    assert twin.checkpointing.value == "none"
    selective, none = estimate_mesh(model, training), estimate_mesh(model, twin)
    assert [(r.kind, r.params, r.estimate.phases) for r in selective.ranks] == \
        [(r.kind, r.params, r.estimate.phases) for r in none.ranks]


def test_the_ring_tells_selective_checkpointing_apart():
    model = resolve_model("llama-3-8b")
    training = TrainingSpec(engine="fsdp2", zero_stage=2, gpus=16, seq_len=4096, recipe="torchtitan",
                            mesh=MeshSpec(tp=2, cp=2), checkpointing="selective")
    assert memory_twin(model, training) is training
    none = training.varied(checkpointing="none")
    assert estimate_mesh(model, training).worst.estimate.peak_bytes != estimate_mesh(model, none).worst.estimate.peak_bytes


@pytest.mark.parametrize("recipe, gpus, seq_len, budget_gib, top", [
    ("torchtitan", 16, 4096, 76, 3),
    ("torchtitan", 64, 8192, 50, 2),
    ("torchtitan", 32, 8192, 76, 1),
    ("hf-trainer", 32, 8192, 76, 2),
])
def test_the_cost_bound_shows_the_plans_of_the_search_without_it(recipe, gpus, seq_len, budget_gib, top):
    model = resolve_model("llama-3-8b")
    base = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=gpus, seq_len=seq_len, recipe=recipe)

    def search(cost_bound):
        clear_caches()
        return _plan(model, base, budget_gib * 2**30, top, cost_bound)

    bounded, full = search(True), search(False)
    assert bounded["cost_bounded"] > 0 and full["cost_bounded"] == 0
    assert bounded["evaluated"] < full["evaluated"] and bounded["fitting"] <= full["fitting"]
    head = render_plan(bounded).splitlines()[0]
    assert f"searched {bounded['evaluated']:,} configurations" in head and f"{bounded['fitting']:,} fit" in head
    assert head.endswith(f"; {bounded['cost_bounded']:,} more choices could not rank in the top {top} at any "
                         "micro-batch (a bound on their cost) and were not checked")
    assert "more choices could not rank" not in render_plan(full).splitlines()[0]
    for found in (bounded, full):
        for key in ("evaluated", "fitting", "cost_bounded", "estimate_calls", "notes"):
            del found[key]
    assert bounded == full and bounded["top"]


@pytest.mark.parametrize("engine, mesh", [
    ("fsdp2", MeshSpec(tp=2, pp=4)),
    ("fsdp2", MeshSpec(tp=4, pp=2, pp_schedule=PPSchedule.INTERLEAVED_1F1B, pp_virtual_stages=2)),
    ("deepspeed", MeshSpec(tp=2)),
])
def test_a_rank_kinds_parameters_are_those_of_its_estimate(engine, mesh):
    from zeroplan.estimate import rank_params

    model = resolve_model("llama-3-8b")
    recipe = {"recipe": "torchtitan"} if engine == "fsdp2" else {}
    training = TrainingSpec(engine=engine, zero_stage=2, gpus=16, seq_len=4096, grad_accum=2 * mesh.pp, mesh=mesh, **recipe)
    ranks = estimate_mesh(model, training).ranks
    assert len({rank.params for rank in ranks}) > 1 or mesh.pp == 1
    assert [rank_params(model, training, rank.kind) for rank in ranks] == [rank.params for rank in ranks]

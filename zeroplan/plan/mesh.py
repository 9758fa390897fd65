"""`zeroplan plan --mesh`: search tensor, context and pipeline parallel degrees (and the pipeline schedule)
with ZeRO/FSDP2 for the meshes whose worst rank fits, ranked by `zeroplan.plan.mesh_cost` (issue 14).

For each mesh (tp x cp x pp x schedule x checkpointing) the largest micro-batch whose worst rank fits is found
by bisection (the per-rank peak never shrinks as it grows: activations and the pipeline's buffers scale with
it), and the mesh is shown once, at its cheapest micro-batch that fits. Every configuration shown has had a
full per-rank estimate (`estimate_mesh`); a fit check stops at the first rank over the budget, and a mesh the
training spec's world rule refuses is not tried (tests/test_mesh_plan_speed.py: the same plan as without)."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from zeroplan.errors import SpecError
from zeroplan.estimate.activations.transformer import memory_checkpointing
from zeroplan.estimate import estimate_mesh, estimate_mesh_within, middle_ranks_peak_bound, rank_estimate, rank_params
from zeroplan.estimate.result import MeshEstimate, RankEstimate, RankKind
from zeroplan.estimate.parallel.mesh import rank_kinds
from zeroplan.plan.cost import Assumptions, model_flops
from zeroplan.plan.mesh_cost import MeshStepCost, mesh_step_cost
from zeroplan.spec.mesh import MeshSpec, PPSchedule, check_mesh, routed_experts
from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.training import Checkpointing, TrainingSpec

_DEGREES = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class MeshCandidate:
    training: TrainingSpec
    estimate: MeshEstimate
    cost: MeshStepCost
    reason: str = ""


@dataclass(frozen=True)
class _Fit:
    """A mesh at its cheapest micro-batch that fits, with its worst rank (the full estimate is made for the shown)."""

    training: TrainingSpec
    worst: RankEstimate
    cost: MeshStepCost


@dataclass(frozen=True)
class MeshPlan:
    model_name: str
    gpus: int
    budget_bytes: int
    evaluated: int
    fitting: int
    top: tuple[MeshCandidate, ...]
    bounded: int = 0  # meshes (by checkpointing) not checked: at no micro-batch could they rank in `top` (`_cost_above`)


def _meshes(model: TransformerSpec, base: TrainingSpec, given: dict[str, Any]) -> list[MeshSpec]:
    """tp within a node and dividing the heads; cp while each rank keeps 1024 tokens or more; pp up to 16 stages
    with 1F1B and Interleaved 1F1B (2 stages per rank, torchtitan's default for looped schedules); for each, plain
    FSDP over every data-parallel rank and HSDP (`_replicas`), and for a MoE model every ep (`_expert_degrees`).
    A dimension in `given` (MeshSpec field: value) takes that value only; the model's rules then judge it."""
    gpus, seq = base.gpus, base.seq_len

    def choices(name: str, searched: list) -> list:
        return [given[name]] if name in given else searched

    switches = {name: given[name] for name in ("sequence_parallel", "loss_parallel") if name in given}
    meshes = []
    for tp in choices("tp", [tp for tp in _DEGREES if tp <= base.node_gpus and not model.num_heads % tp
                             and not model.kv_heads % tp]):
        for cp in choices("cp", [cp for cp in _DEGREES if not seq % (2 * cp) and (cp == 1 or seq // cp >= 1024)
                                 and not (seq // cp) % tp]):
            for pp in choices("pp", [pp for pp in (1, 2, 4, 8, 16) if model.num_layers >= pp]):
                if gpus % (tp * cp * pp):
                    continue
                schedules = [(PPSchedule.ONE_F_ONE_B, 1)]
                if pp > 1 and model.num_layers >= 2 * pp:
                    schedules.append((PPSchedule.INTERLEAVED_1F1B, 2))
                if "pp_schedule" in given:
                    schedule = PPSchedule(given["pp_schedule"])
                    schedules = [(schedule, given.get("pp_virtual_stages", 2 if schedule.looped and pp > 1 else 1))]
                elif "pp_virtual_stages" in given:
                    schedules = [(s, v) for s, v in schedules if v == given["pp_virtual_stages"]]
                data_parallel = gpus // (tp * cp * pp)
                for schedule, virtual in schedules:
                    for replicas in choices("dp_replicate", _replicas(tp * cp, data_parallel, base.node_gpus)):
                        if data_parallel % replicas:
                            continue
                        for ep in choices("ep", _expert_degrees(model, data_parallel // replicas * cp * tp)):
                            meshes.append(MeshSpec(tp=tp, cp=cp, pp=pp, pp_schedule=schedule, pp_virtual_stages=virtual,
                                                   ep=ep, dp_replicate=replicas, **switches))
    return meshes


def _replicas(tp_cp: int, data_parallel: int, node_gpus: int) -> list[int]:
    """dp_replicate degrees searched: 1 (FSDP over every data-parallel rank), and HSDP with the shard group
    filling one node beside tp x cp (PyTorch FSDP, Zhao et al. 2023, section 3.2.2 "hybrid sharding": shard
    inside a host, replicate across hosts), so that its gathers and reduce-scatters stay on the node's links.
    A shard group of one GPU is left out: torchtitan then runs DDP, which the estimate does not model."""
    shard = node_gpus // tp_cp
    if shard < 2 or data_parallel % shard or data_parallel == shard:
        return [1]
    return [1, data_parallel // shard]


def _expert_degrees(model: TransformerSpec, borrowed: int) -> list[int]:
    """ep degrees searched for a MoE model: those dividing its experts and the dp_shard x cp x tp ranks expert
    parallelism borrows (torchtitan parallel_dims.py `build_mesh`: efsdp = dp_shard x cp x tp / ep)."""
    experts = routed_experts(model)
    if experts < 2:
        return [1]
    return [ep for ep in _DEGREES if experts % ep == 0 and borrowed % ep == 0]


def _reason(rank: int, candidate: MeshCandidate, best: MeshCandidate | None) -> str:
    """Why it ranks here: what its HSDP and ep degrees buy, its largest costs beside compute, and, below #1, the
    term it pays most more of per token."""
    cost = candidate.cost
    terms = {name: value for name, value in cost.terms().items() if name not in ("compute",) and value > 0}
    top_terms = sorted(terms.items(), key=lambda item: -item[1])[:2]
    share = ", ".join(f"{name} {value / cost.step_s:.0%}" for name, value in top_terms) or "compute only"
    worst = candidate.estimate.worst
    head = f"worst rank {worst.kind.label} at {worst.estimate.peak_bytes / 2**30:.1f} GiB; step beyond compute: {share}"
    mesh, gpus = candidate.training.mesh, candidate.training.gpus
    if mesh.dp_replicate > 1:
        where = "inside a node" if mesh.tp * mesh.cp * mesh.dp_shard(gpus) <= candidate.training.node_gpus else "across nodes"
        head += (f"; HSDP: sharded over {mesh.fsdp_degree(gpus)} GPUs {where}, all-reduced across {mesh.dp_replicate} "
                 f"replicas ({cost.replicate_s / cost.step_s:.0%} of the step)")
    if mesh.ep > 1:
        head += (f"; ep {mesh.ep}: each rank gathers 1/{mesh.ep} of the experts, the all-to-all takes "
                 f"{cost.expert_parallel_s / cost.step_s:.0%} of the step")
    if rank == 1 or best is None:
        return f"cheapest per token; {head}"
    slower = cost.gpu_seconds_per_token / best.cost.gpu_seconds_per_token - 1
    mine, theirs = cost.terms(), best.cost.terms()
    excess = {name: mine[name] / cost.tokens - theirs[name] / best.cost.tokens for name in mine}
    most = max(excess, key=excess.get)
    return f"{slower:.0%} more GPU time per token than #1, most of it in {most}; {head}"


def plan_mesh(model: TransformerSpec, base: TrainingSpec, budget_bytes: int, assumptions: Assumptions,
              checkpointing: tuple[Checkpointing, ...] = (Checkpointing.NONE, Checkpointing.FULL),
              max_micro_batch: int = 16, global_batch: int | None = None, top: int = 5,
              given: dict[str, Any] | None = None, fixed: bool = False, cost_bound: bool = True) -> MeshPlan:
    """The cheapest meshes of `base.gpus` GPUs whose worst rank fits `budget_bytes`. Without `global_batch`,
    a pipeline runs 2 x pp micro-batches per step (torchtitan needs at least pp for 1F1B). `given` fixes some
    dimensions of the search (MeshSpec field: value); `fixed` plans `base.mesh` alone (micro-batch and checkpointing).
    With `cost_bound`, a mesh whose cost at every micro-batch is bounded above that of `top` fitting meshes
    (`_cost_above`) is not checked, only counted (`MeshPlan.bounded`): the plans shown are the same, and fewer
    meshes are checked and found to fit."""
    if not isinstance(model, TransformerSpec):
        raise SpecError("mesh: a model given by parameter count cannot be cut by tp/cp/pp; give its config")
    flops = model_flops(model, *_params(model, base))
    evaluated, fitting, bounded = 0, [], 0  # fitting: _Fit
    costs: list[float] = []  # the fitting ones' GPU seconds per token, ascending
    checked: dict[TrainingSpec, RankEstimate | None] = {}  # fit checks by memory twin (`_memory_twin`)
    meshes = [base.mesh] if fixed else _meshes(model, base, given or {})
    for mesh in meshes:
        if not _world_runs(mesh, base):
            continue  # every micro-batch and checkpointing of it would fail the same validator: none to estimate
        for mode in checkpointing:
            trainings = _micro_batch_specs(base, mesh, mode, max_micro_batch, global_batch)
            # `top` fitting meshes cheaper than this: a mesh whose cost bound is above it cannot be shown
            shown_below = costs[top - 1] if cost_bound and top > 0 and len(costs) >= top else None
            candidate, count = _cheapest_fit(model, flops, trainings, budget_bytes, assumptions, checked, shown_below)
            evaluated += count
            if candidate is _BOUNDED:
                bounded += 1
            elif candidate is not None:
                fitting.append(candidate)
                bisect.insort(costs, candidate.cost.gpu_seconds_per_token)
    if not evaluated and meshes and (fixed or given):
        # every spec of the meshes asked for was refused: say why, in the model's rule's own words
        for training in _micro_batch_specs(base, meshes[0], checkpointing[0], max_micro_batch, global_batch):
            check_mesh(model, training)
    fitting.sort(key=lambda c: (c.cost.gpu_seconds_per_token, c.training.mesh.model_ranks))
    shown = [MeshCandidate(c.training, estimate_mesh(model, c.training), c.cost) for c in fitting[:top]]
    best = shown[0] if shown else None
    ranked = tuple(MeshCandidate(c.training, c.estimate, c.cost, _reason(i, c, best)) for i, c in enumerate(shown, start=1))
    return MeshPlan(model.name, base.gpus, budget_bytes, evaluated, len(fitting), ranked, bounded)


def _micro_batch_specs(base: TrainingSpec, mesh: MeshSpec, mode: Checkpointing, max_micro_batch: int,
                       global_batch: int | None) -> Iterator[TrainingSpec]:
    """The mesh's specs by micro-batch, ascending, up to the first that does not validate; made as they are
    asked for (most meshes stop at the first, which does not fit)."""
    first = None
    for micro in (m for m in _DEGREES if m <= max_micro_batch):
        accum = _accumulation(mesh, base.gpus, micro, global_batch)
        if accum is None:
            continue
        if first is not None and accum == first.grad_accum:
            # only micro_batch differs from a spec that validated, and it is checked by its own field alone (ge=1)
            yield first.model_copy(update={"micro_batch": micro})
            continue
        try:
            first = base.varied(mesh=mesh, checkpointing=mode, micro_batch=micro, grad_accum=accum,
                                zero_stage=2 if mesh.pp > 1 else base.zero_stage)
        except SpecError:
            return
        yield first


_BOUNDED = object()  # `_cheapest_fit`: not checked, as it could not be shown (`_cost_above`)


def _cheapest_fit(model: TransformerSpec, flops, specs: Iterator[TrainingSpec], budget_bytes: int,
                  assumptions: Assumptions, checked: dict, shown_below: float | None = None) -> tuple[Any, int]:
    """The cheapest of `specs` (one mesh, micro-batches ascending) whose worst rank fits, and the estimates
    made. The worst rank's peak never shrinks as the micro-batch grows, so the ones that fit are a prefix,
    found by bisection; their costs use the worst rank kind of the largest that fits, and the cheapest gets a
    fit check of its own. `checked` keeps the plan's fit checks by memory twin (`_memory_twin`). `_BOUNDED`, and
    none made, when `_cost_above` finds every cost it could return above `shown_below`."""
    trainings = list(itertools.islice(specs, 1))  # the rest are made only when the first fits, or for the bound
    if trainings and shown_below is not None:
        trainings.extend(specs)
        if _cost_above(model, flops, trainings, assumptions, shown_below):
            return _BOUNDED, 0
    worst: dict[int, RankEstimate | None] = {}  # None: a rank is over the budget (or the spec is invalid)

    def fits(index: int) -> bool:
        if index not in worst:
            try:
                twin = _memory_twin(model, trainings[index])
                if twin not in checked:
                    checked[twin] = _worst_within(model, trainings[index], budget_bytes)
                worst[index] = checked[twin]
            except SpecError:
                return False
        return worst[index] is not None

    if not trainings or not fits(0):
        return None, len(worst)
    trainings.extend(specs)
    low, high = 0, len(trainings)  # trainings[low] fits, trainings[high] does not (or is past the end)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    largest = worst[low]
    costs = [mesh_step_cost(model, flops, largest.params, largest.kind.layers, training, assumptions)
             for training in trainings[:low + 1]]
    best = min(range(low + 1), key=lambda index: costs[index].gpu_seconds_per_token)
    if best not in worst:
        fits(best)
    chosen = worst[best]
    cost = mesh_step_cost(model, flops, chosen.params, chosen.kind.layers, trainings[best], assumptions)
    return _Fit(trainings[best], chosen, cost), len(worst)


def _cost_above(model: TransformerSpec, flops, trainings: list[TrainingSpec], assumptions: Assumptions,
                shown_below: float) -> bool:
    """Whether every cost `_cheapest_fit` could return for `trainings` (one mesh, every micro-batch whose spec
    validates) is above `shown_below`. Its cost is `mesh_step_cost` of one of them for the worst rank's parameters and
    layers, those of one of the mesh's rank kinds (the same kinds at every micro-batch: mesh, gpus and freeze are the
    same). `mesh_step_cost` never falls as `rank_params` or `layers` grow: each enters its terms as a factor of a
    product of non-negative numbers and positive divisors, the terms are added, and rounding is monotone. Every kind
    holds at least the fewest layers of any kind, as many blocks of the same shapes as a middle rank with those
    layers holds (`rank_facts`; `rank_params` is their sum), so that rank's parameters and layers give each
    micro-batch's cost a floor."""
    mesh = trainings[0].mesh
    if mesh.is_trivial:  # one rank kind, the whole model's (`estimate_mesh`): not bounded here
        return False
    kinds = rank_kinds(model, mesh, trainings[0].grad_accum if mesh.pp > 1 else 1)
    layers = min(kind.layers for kind in kinds)
    params = rank_params(model, trainings[0], RankKind(0, (0,), layers, False, False, 0)) if layers else 0
    # the largest micro-batch first: the cheapest per token most often, ending the test at once when it is not above
    return all(mesh_step_cost(model, flops, params, layers, training, assumptions).gpu_seconds_per_token > shown_below
               for training in reversed(trainings))


def _memory_twin(model: TransformerSpec, training: TrainingSpec) -> TrainingSpec:
    """The spec whose fit check `training`'s is: under selective checkpointing that `memory_checkpointing` finds
    keeping what none keeps, the spec without checkpointing, where no FSDP2 ring runs (cp 1). The engine profiles see
    checkpointing through the activations alone, the mesh's own terms (sequence and expert parallelism, the
    pipeline) only as full or op or neither; the ring's tell selective apart (estimate/parallel/context.py). The fit check
    reads the worst rank's peak, parameters and layers only, which the twins share (tests/test_mesh_plan_speed.py)."""
    if (training.checkpointing != Checkpointing.SELECTIVE or training.mesh.cp > 1
            or memory_checkpointing(training, model) != Checkpointing.NONE):
        return training
    return training.model_copy(update={"checkpointing": Checkpointing.NONE})


def _worst_within(model: TransformerSpec, training: TrainingSpec, budget_bytes: int) -> RankEstimate | None:
    """`estimate_mesh_within(...).worst`, or None when a rank is over the budget, from the rank kinds that can be
    the worst only (`_may_be_worst`), the ends of the pipeline first. Middle ranks of an interleaved schedule
    that share a profile are first bounded together (`middle_ranks_peak_bound`): if the bound fits and is below
    the worst so far (or no higher than rank 0, which comes first on a tie), none of them is the worst, and
    none is estimated."""
    mesh = training.mesh
    if mesh.is_trivial:
        whole = estimate_mesh_within(model, training, budget_bytes)
        return None if whole is None else whole.worst
    check_mesh(model, training)
    kinds = rank_kinds(model, mesh, training.grad_accum if mesh.pp > 1 else 1)
    ranks: dict[int, RankEstimate] = {}
    for group in _estimate_groups(kinds, _may_be_worst(kinds)):
        if len(group) > 1 and ranks:
            bound = middle_ranks_peak_bound(model, training, tuple(kinds[index] for index in group))
            worst = max(rank.estimate.peak_bytes for rank in ranks.values())
            first = ranks[0].estimate.peak_bytes if 0 in ranks else -1
            if bound is not None and bound <= budget_bytes and (bound < worst or bound <= first):
                continue
        for index in group:
            ranks[index] = rank_estimate(model, training, kinds[index])
            if ranks[index].estimate.peak_bytes > budget_bytes:
                return None
    return max((ranks[index] for index in sorted(ranks)), key=lambda rank: rank.estimate.peak_bytes)


def _estimate_groups(kinds: list[RankKind], order: list[int]) -> list[list[int]]:
    """`order` in groups: the middle ranks (neither embedding nor head) with the same layers and stage count
    together, where the first of them stood; every other rank alone."""
    groups: dict[tuple, list[int]] = {}
    for index in order:
        kind = kinds[index]
        key = (kind.layers, len(kind.stages)) if not (kind.embedding or kind.head) else index
        groups.setdefault(key, []).append(index)
    return list(groups.values())


def _may_be_worst(kinds: list[RankKind]) -> list[int]:
    """The rank kinds whose peak may be the highest, the ends of the pipeline first. A rank with one stage, no
    embedding and no head, and no more layers nor micro-batches in flight than pp rank 1 (also such a rank) is
    left out: its estimate is rank 1's with every term no larger. Its parameters, gradients and optimizer states
    are sums over fewer blocks of the same shapes, sharded alike; FSDP2 gathers the same block unit; its saved
    activations are per block times blocks plus one stage's per extra micro-batch in flight; its pipeline receive
    buffers are as many (one stage, neither end). So its peak is at most rank 1's, and rank 1, coming first, is
    what `max` picks on a tie. Under GPipe and 1F1B this leaves pp ranks 0, 1 and the last (`stage_layers` gives
    the remainder to the first stages, 1F1B keeps min(n, pp - rank) in flight); looped schedules keep them all."""
    ends = [0, len(kinds) - 1] if len(kinds) > 1 else [0]
    if len(kinds) < 4:
        return ends + list(range(1, len(kinds) - 1))
    first = kinds[1]
    comparable = len(first.stages) == 1 and not (first.embedding or first.head)
    return ends + [1] + [index for index in range(2, len(kinds) - 1)
                         if not (comparable and len(kinds[index].stages) == 1 and not kinds[index].embedding
                                 and not kinds[index].head and kinds[index].layers <= first.layers
                                 and kinds[index].in_flight <= first.in_flight)]


def _world_runs(mesh: MeshSpec, base: TrainingSpec) -> bool:
    """Whether the mesh passes `MeshSpec.check_world` as TrainingSpec's validator calls it for the specs varied
    below (the same gpus, engine, recipe and zero stage for every micro-batch and checkpointing)."""
    try:
        mesh.check_world(base.gpus, base.engine.value, 2 if mesh.pp > 1 else base.zero_stage, base.recipe.value)
    except ValueError:
        return False
    return True


def _params(model: TransformerSpec, base: TrainingSpec) -> tuple[int, int]:
    from zeroplan.estimate.model.facts import model_facts

    facts = model_facts(model, base)
    return facts.total_params, facts.trainable_params


def _accumulation(mesh: MeshSpec, gpus: int, micro: int, global_batch: int | None) -> int | None:
    """Micro-batches per step: the global batch over the data-parallel ranks, or 2 x pp under a pipeline."""
    data_parallel = gpus // mesh.model_ranks
    if global_batch is None:
        return 2 * mesh.pp if mesh.pp > 1 else 1
    if global_batch % (data_parallel * micro):
        return None
    return global_batch // (data_parallel * micro)


def mesh_plan_to_dict(plan: MeshPlan) -> dict[str, Any]:
    """`zeroplan plan --mesh` as plain data: every shown mesh, its worst rank's peak, its cost terms and reason."""
    from zeroplan.estimate.serialize import per_gpu_to_dict
    from zeroplan.estimate.serialize import mesh_to_dict

    return {
        "model": plan.model_name, "gpus": plan.gpus, "budget": plan.budget_bytes, "evaluated": plan.evaluated,
        "fitting": plan.fitting, "cost_bounded": plan.bounded,
        "top": [{"rank": rank, "mesh": mesh_to_dict(c.training), "checkpointing": c.training.checkpointing.value,
                 "zero_stage": c.training.zero_stage, "micro_batch": c.training.micro_batch,
                 "grad_accum": c.training.grad_accum, "worst_rank": c.estimate.worst.kind.label,
                 "per_gpu": per_gpu_to_dict(c.estimate.worst.estimate), "step_s": c.cost.step_s,
                 "tokens_per_s_per_gpu": c.cost.tokens_per_s, "cost_terms_s": c.cost.terms(), "reason": c.reason}
                for rank, c in enumerate(plan.top, start=1)],
    }

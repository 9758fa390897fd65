"""Whether a mesh configuration's worst rank fits, with as few rank estimates as the argument allows: the ends
of the pipeline first, the first rank over the budget ending the check, the middle ranks no higher than rank 1
left out (`may_be_worst`) and those of an interleaved schedule bounded together (`middle_ranks_peak_bound`).
tests/plan/test_mesh_speed.py checks every shortcut against full estimates."""

from __future__ import annotations

from zeroplan.estimate.activations.transformer import memory_checkpointing
from zeroplan.estimate.parallel.mesh import rank_kinds
from zeroplan.estimate.pipeline import estimate_mesh_within, middle_ranks_peak_bound, rank_estimate
from zeroplan.estimate.result import RankEstimate, RankKind
from zeroplan.spec.mesh import check_mesh
from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.training import Checkpointing, TrainingSpec


def memory_twin(model: TransformerSpec, training: TrainingSpec) -> TrainingSpec:
    """The spec whose fit check `training`'s is: under selective checkpointing that `memory_checkpointing` finds
    keeping what none keeps, the spec without checkpointing, where no FSDP2 ring runs (cp 1). The engine profiles see
    checkpointing through the activations alone, the mesh's own terms (sequence and expert parallelism, the
    pipeline) only as full or op or neither; the ring's tell selective apart (estimate/mesh_cp.py). The fit check
    reads the worst rank's peak, parameters and layers only, which the twins share (tests/plan/test_mesh_speed.py)."""
    if (training.checkpointing != Checkpointing.SELECTIVE or training.mesh.cp > 1
            or memory_checkpointing(training, model) != Checkpointing.NONE):
        return training
    return training.model_copy(update={"checkpointing": Checkpointing.NONE})


def worst_within(model: TransformerSpec, training: TrainingSpec, budget_bytes: int) -> RankEstimate | None:
    """`estimate_mesh_within(...).worst`, or None when a rank is over the budget, from the rank kinds that can be
    the worst only (`may_be_worst`), the ends of the pipeline first. Middle ranks of an interleaved schedule
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
    for group in estimate_groups(kinds, may_be_worst(kinds)):
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


def estimate_groups(kinds: list[RankKind], order: list[int]) -> list[list[int]]:
    """`order` in groups: the middle ranks (neither embedding nor head) with the same layers and stage count
    together, where the first of them stood; every other rank alone."""
    groups: dict[tuple, list[int]] = {}
    for index in order:
        kind = kinds[index]
        key = (kind.layers, len(kind.stages)) if not (kind.embedding or kind.head) else index
        groups.setdefault(key, []).append(index)
    return list(groups.values())


def may_be_worst(kinds: list[RankKind]) -> list[int]:
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

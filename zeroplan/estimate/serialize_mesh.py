"""The JSON contract of a mesh estimate (issue 14): the worst rank's estimate at the top level, in
`estimate_to_dict`'s shape (so a reader of single-rank estimates reads the rank that decides the fit),
with the mesh and every rank kind's per-GPU peak and phases beside it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from zeroplan.estimate.mesh import MeshEstimate
from zeroplan.estimate.serialize import estimate_to_dict, per_gpu_to_dict, phase_to_dict
from zeroplan.spec.training import TrainingSpec


def mesh_to_dict(training: TrainingSpec) -> dict[str, Any]:
    """The degrees, the schedule, and what data parallelism is left: dp_shard, and the FSDP/ZeRO sharding degrees."""
    mesh, gpus = training.mesh, training.gpus
    dumped = mesh.model_dump(mode="json")  # every knob, moe_imbalance's assumed 1.0 (balanced routing) included
    return {**dumped, "dp_shard": mesh.dp_shard(gpus), "fsdp_degree": mesh.fsdp_degree(gpus),
            "expert_fsdp_degree": mesh.expert_fsdp_degree(gpus)}


def mesh_estimate_to_dict(result: MeshEstimate, training: TrainingSpec, gpu_memory_bytes: int | None = None,
                          notes: Iterable[str] = ()) -> dict[str, Any]:
    worst = result.worst
    data = estimate_to_dict(worst.estimate, training, gpu_memory_bytes, notes)
    data["mesh"] = mesh_to_dict(training)
    data["ranks"] = [
        {
            "kind": rank.kind.label,
            "pp_rank": rank.kind.pp_rank,
            "stages": list(rank.kind.stages),
            "layers": rank.kind.layers,
            "embedding": rank.kind.embedding,
            "head": rank.kind.head,
            "micro_batches_in_flight": rank.kind.in_flight,
            "ranks": rank.ranks,
            "params": rank.params,
            "per_gpu": per_gpu_to_dict(rank.estimate),
            "phases": [phase_to_dict(phase) for phase in rank.estimate.phases],
        }
        for rank in result.ranks
    ]
    if gpu_memory_bytes is not None:
        for rank in data["ranks"]:
            rank["fits"] = rank["per_gpu"]["peak"] <= gpu_memory_bytes
    data["worst_rank"] = result.ranks.index(worst)
    return data

"""DeepSpeed's mesh keys <-> zeroplan's mesh (issue 14): AutoTP's `tensor_parallel.autotp_size` and Ulysses'
`sequence_parallel_size` (deepspeed/runtime/config.py: `get_tensor_parallel_config`, `sequence_parallel_size`;
runtime/tensor_parallel/config.py `TPTrainingConfig.autotp_size`).

DeepSpeed checks train_batch_size = micro x accumulation x world / sequence_parallel_size (runtime/config.py
`DeepSpeedConfig.__init__`: `world_size = dist.get_world_size() / mpu.get_sequence_parallel_world_size()` under
Ulysses, the whole world otherwise, AutoTP included), then `_batch_assertion`.
"""

from __future__ import annotations

from collections.abc import Mapping

from zeroplan.importers.values import as_int, as_section, fail, Where
from zeroplan.spec.training import TrainingSpec

MESH_KEYS = ("tensor_parallel", "sequence_parallel_size")


def mesh_section(training: TrainingSpec) -> dict[str, object]:
    """The top-level keys that run `training.mesh` (only the degrees above one)."""
    mesh, section = training.mesh, {}
    if mesh.tp > 1:
        section["tensor_parallel"] = {"autotp_size": mesh.tp}
    if mesh.cp > 1:
        section["sequence_parallel_size"] = mesh.cp
    return section


def batch_ranks(training: TrainingSpec) -> int:
    """DeepSpeed's batch check counts world / this many ranks (module docstring): Ulysses' degree."""
    return training.mesh.cp


def mesh_from_deepspeed(config: Mapping[str, object], where: Where) -> dict[str, int]:
    """The mesh degrees a DeepSpeed config sets; empty when it sets none."""
    mesh: dict[str, int] = {}
    tensor_parallel = config.get("tensor_parallel")
    if tensor_parallel is not None:
        section = as_section(tensor_parallel, "tensor_parallel", where)
        size = section.get("autotp_size", section.get("tp_size"))
        if size is not None:
            tp = as_int(size, "tensor_parallel.autotp_size", where, minimum=1)
            if tp > 1:
                mesh["tp"] = tp
    sequence = config.get("sequence_parallel_size")
    if sequence is not None:
        cp = as_int(sequence, "sequence_parallel_size", where, minimum=1)
        if cp > 1:
            mesh["cp"] = cp
    return mesh

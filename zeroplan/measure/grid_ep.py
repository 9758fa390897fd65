"""The expert-parallel rows of the accuracy grid (issue 14, measure/engines/mesh_moe.py): qwen3moe-tiny
(8 experts, top-2) in torchtitan's loop with its standard loss, on 2 and 4 real gloo ranks: ep alone
(each expert unsharded within its efsdp group of one), ep 2 x efsdp 2, ep 4, and ep with full
checkpointing in bf16. Each row's estimate takes the load imbalance its run measured
(`with_measured_imbalance`)."""

from __future__ import annotations

from collections.abc import Iterable

from typing import Any

from zeroplan.spec.training import TrainingSpec

IMBALANCE_NOTE = "moe imbalance measured: "  # measure/engines/mesh_moe.py writes it, the busiest rank's received pairs over the mean


def ep_rows(Row: type) -> list[Any]:
    """`Row`: measure/grid.py's row type, passed in (that module builds its rows from these at import)."""
    titan = {"recipe": "torchtitan", "loss": "standard"}
    return [
        Row("qwen3moe-tiny", "fsdp2", 3, "fp32", mesh=(("ep", 2),), **titan),
        Row("qwen3moe-tiny", "fsdp2", 3, "fp32", mesh=(("ep", 2),), world=4, **titan),
        Row("qwen3moe-tiny", "fsdp2", 3, "fp32", mesh=(("ep", 4),), world=4, **titan),
        Row("qwen3moe-tiny", "fsdp2", 3, "bf16", checkpointing="full", mesh=(("ep", 2),), world=4, **titan),
        Row("qwen3moe-tiny", "fsdp2", 2, "bf16", mesh=(("ep", 2),), **titan),
    ]


def measured_imbalance(notes: Iterable[str]) -> float | None:
    """The factor a run's note reports (measure/engines/mesh_moe.py), or None."""
    for note in notes:
        if note.startswith(IMBALANCE_NOTE):
            return float(note[len(IMBALANCE_NOTE):].split()[0])
    return None


def with_measured_imbalance(training: TrainingSpec, notes: Iterable[str]) -> TrainingSpec:
    """`training` with the moe_imbalance its expert-parallel run measured: the routing of that run, an
    input of the estimate as the batch is, not a fit of its bytes. Other runs are returned as they are."""
    factor = measured_imbalance(notes)
    if training.mesh.ep == 1 or factor is None:
        return training
    return training.varied(mesh=training.mesh.model_copy(update={"moe_imbalance": max(1.0, min(factor, training.mesh.ep))}))

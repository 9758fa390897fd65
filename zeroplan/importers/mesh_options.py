"""The mesh options (`--tp`, `--pp`, ... as `mesh_<field>`) laid over the mesh a config file gives."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zeroplan.errors import SpecError
from zeroplan.spec.mesh import MeshSpec


# Options that tune one mesh dimension, and that dimension: given while it is 1 they change nothing.
_TUNES = {"pp_virtual_stages": ("pp", "--pp"), "pp_schedule": ("pp", "--pp"), "sequence_parallel": ("tp", "--tp"),
          "loss_parallel": ("tp", "--tp"), "moe_imbalance": ("ep", "--ep")}


def mesh_values(options: Mapping[str, Any], values: dict[str, Any]) -> None:
    """Set `values["mesh"]` (a field mapping, validated with the rest of the TrainingSpec) from the options given.
    An option that tunes a dimension the mesh does not have is refused (`plan --mesh`, which searches the
    dimensions, keeps it for the meshes that have it)."""
    given = {name: options[f"mesh_{name}"] for name in MeshSpec.model_fields if options.get(f"mesh_{name}") is not None}
    if given:
        base = values.get("mesh") or {}
        values["mesh"] = {**(base.model_dump() if isinstance(base, MeshSpec) else base), **given}
    if options.get("mesh_search"):
        return
    for name, (dimension, option) in _TUNES.items():
        if name in given and values["mesh"].get(dimension, 1) == 1:
            flag = f"--{name.replace('_', '-')}"
            if given[name] is False:
                flag = f"--no-{name.replace('_', '-')}"
            raise SpecError(f"{flag}: tunes {dimension}, which is 1 here (no {_DIMENSION_NAMES[dimension]}), so it "
                            f"changes nothing; give {option} N (2 or more), or leave it out")


_DIMENSION_NAMES = {"pp": "pipeline", "tp": "tensor parallelism", "ep": "expert parallelism"}


# torch.distributed.pipelining get_schedule_class names (case-insensitive) -> the schedules modelled
_TORCHTITAN_SCHEDULES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved1f1b": "interleaved-1f1b",
                         "interleavedzerobubble": "zero-bubble"}


def torchtitan_mesh(parallelism: Mapping[str, object], layers: int | None, where: Any) -> dict[str, Any]:
    """The mesh a torchtitan `[parallelism]` table gives (torchtitan config/configs.py `ParallelismConfig`);
    `layers` (the model's, when known) turns pipeline_parallel_layers_per_stage into virtual stages
    (distributed/pipeline_parallel.py: ceil((layers + 2) / layers_per_stage) stages over pp ranks, else 1 per
    rank for a single-stage schedule and 2 for a looped one)."""
    from zeroplan.importers.values import as_bool, as_int, fail

    def degree(key: str) -> int:
        return as_int(parallelism.get(key, 1), f"parallelism.{key}", where, 1)

    mesh: dict[str, Any] = {"tp": degree("tensor_parallel_degree"), "cp": degree("context_parallel_degree"),
                            "pp": degree("pipeline_parallel_degree"), "ep": degree("expert_parallel_degree"),
                            "dp_replicate": degree("data_parallel_replicate_degree")}
    if degree("expert_tensor_parallel_degree") > 1:
        raise fail(where, "parallelism.expert_tensor_parallel_degree", "is more than 1: not modelled (experts are "
                   "cut by ep only, as torchtitan 0.3.0 does)")
    if "enable_sequence_parallel" in parallelism:  # 0.3.0; v0.2.2 always runs SP under TP
        mesh["sequence_parallel"] = as_bool(parallelism["enable_sequence_parallel"],
                                            "parallelism.enable_sequence_parallel", where)
    if "disable_loss_parallel" in parallelism:
        mesh["loss_parallel"] = not as_bool(parallelism["disable_loss_parallel"], "parallelism.disable_loss_parallel", where)
    if mesh["pp"] > 1:
        name = str(parallelism.get("pipeline_parallel_schedule", "1F1B"))
        schedule = _TORCHTITAN_SCHEDULES.get(name.lower())
        if schedule is None:
            raise fail(where, "parallelism.pipeline_parallel_schedule", f"{name!r} is not modelled; use GPipe, 1F1B, "
                       "Interleaved1F1B or InterleavedZeroBubble")
        looped = schedule in ("interleaved-1f1b", "zero-bubble")
        virtual = 2 if looped else 1
        per_stage = parallelism.get("pipeline_parallel_layers_per_stage")
        if per_stage is not None and layers is not None:
            stages = -(-(layers + 2) // as_int(per_stage, "parallelism.pipeline_parallel_layers_per_stage", where, 1))
            if stages % mesh["pp"]:
                raise fail(where, "parallelism.pipeline_parallel_layers_per_stage", f"gives {stages} stages, not a "
                           f"multiple of pipeline_parallel_degree {mesh['pp']} (torchtitan refuses it)")
            virtual = stages // mesh["pp"]
        mesh.update(pp_schedule=schedule, pp_virtual_stages=virtual)
    return mesh


def pipeline_micro_batch(parallelism: Mapping[str, object], local_batch: int, where: Any) -> tuple[int, int]:
    """(sequences per pipeline micro-batch, micro-batches per local batch): torchtitan splits each rank's
    local_batch_size into micro-batches of pipeline_parallel_microbatch_size (default 1)."""
    from zeroplan.importers.values import as_int, fail

    size = as_int(parallelism.get("pipeline_parallel_microbatch_size", 1), "parallelism.pipeline_parallel_microbatch_size",
                  where, 1)
    if local_batch % size:
        raise fail(where, "parallelism.pipeline_parallel_microbatch_size", f"{size} does not divide local_batch_size "
                   f"{local_batch}")
    return size, local_batch // size

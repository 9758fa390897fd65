"""The meshes `plan --mesh` searches for a model on a GPU count (issue 14): tensor, context and pipeline degrees,
pipeline schedules, HSDP replicas and, for a MoE model, expert parallelism. A dimension given stays fixed."""

from __future__ import annotations

from typing import Any

from zeroplan.spec.mesh import MeshSpec, PPSchedule, routed_experts
from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.training import TrainingSpec

DEGREES = (1, 2, 4, 8, 16, 32)


def meshes(model: TransformerSpec, base: TrainingSpec, gpus: int, given: dict[str, Any]) -> list[MeshSpec]:
    """tp within a node and dividing the heads; cp while each rank keeps 1024 tokens or more; pp up to 16 stages
    with 1F1B and Interleaved 1F1B (2 stages per rank, torchtitan's default for looped schedules); for each, plain
    FSDP over every data-parallel rank and HSDP (`replica_degrees`), and for a MoE model every ep
    (`expert_degrees`). A dimension in `given` (MeshSpec field: value) takes that value only; the model's rules
    then judge it. Meshes whose degrees do not divide `gpus` are left out (never an error: the search skips them)."""
    seq = base.seq_len
    node_gpus = min(base.gpus_per_node or 8, gpus)

    def choices(name: str, searched: list) -> list:
        return [given[name]] if name in given else searched

    switches = {name: given[name] for name in ("sequence_parallel", "loss_parallel") if name in given}
    found = []
    for tp in choices("tp", [tp for tp in DEGREES if tp <= node_gpus and not model.num_heads % tp
                             and not model.kv_heads % tp]):
        for cp in choices("cp", [cp for cp in DEGREES if not seq % (2 * cp) and (cp == 1 or seq // cp >= 1024)
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
                    for replicas in choices("dp_replicate", replica_degrees(tp * cp, data_parallel, node_gpus)):
                        if data_parallel % replicas:
                            continue
                        for ep in choices("ep", expert_degrees(model, data_parallel // replicas * cp * tp)):
                            found.append(MeshSpec(tp=tp, cp=cp, pp=pp, pp_schedule=schedule, pp_virtual_stages=virtual,
                                                  ep=ep, dp_replicate=replicas, **switches))
    return found


def replica_degrees(tp_cp: int, data_parallel: int, node_gpus: int) -> list[int]:
    """dp_replicate degrees searched: 1 (FSDP over every data-parallel rank), and HSDP with the shard group
    filling one node beside tp x cp (PyTorch FSDP, Zhao et al. 2023, section 3.2.2 "hybrid sharding": shard
    inside a host, replicate across hosts), so that its gathers and reduce-scatters stay on the node's links.
    A shard group of one GPU is left out: torchtitan then runs DDP, which the estimate does not model."""
    shard = node_gpus // tp_cp
    if shard < 2 or data_parallel % shard or data_parallel == shard:
        return [1]
    return [1, data_parallel // shard]


def expert_degrees(model: TransformerSpec, borrowed: int) -> list[int]:
    """ep degrees searched for a MoE model: those dividing its experts and the dp_shard x cp x tp ranks expert
    parallelism borrows (torchtitan parallel_dims.py `build_mesh`: efsdp = dp_shard x cp x tp / ep)."""
    experts = routed_experts(model)
    if experts < 2:
        return [1]
    return [ep for ep in DEGREES if experts % ep == 0 and borrowed % ep == 0]


def world_runs(mesh: MeshSpec, gpus: int, base: TrainingSpec, zero_stage: int) -> bool:
    """Whether the mesh passes `MeshSpec.check_world` as TrainingSpec's validator calls it for the specs varied
    from `base` (the same engine and recipe for every micro-batch and checkpointing)."""
    try:
        mesh.check_world(gpus, base.engine.value, zero_stage, base.recipe.value)
    except ValueError:
        return False
    return True


def mesh_label(mesh: MeshSpec, gpus: int) -> str:
    """A mesh in one short phrase: "tp 8 pp 4 1f1b dp 2 x 2 replicas ep 8" (the degrees beyond one)."""
    parts = [f"{name} {getattr(mesh, name)}" for name in ("tp", "cp") if getattr(mesh, name) > 1]
    if mesh.pp > 1:
        parts.append(f"pp {mesh.pp} {mesh.pp_schedule.value}")
    parts.append(f"dp {mesh.dp_shard(gpus)}" + (f" x {mesh.dp_replicate} replicas" if mesh.dp_replicate > 1 else ""))
    if mesh.ep > 1:
        parts.append(f"ep {mesh.ep}")
    return " ".join(parts)

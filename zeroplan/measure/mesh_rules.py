"""What `zeroplan measure` runs on a device mesh, checked before any worker starts (no torch here).

measure/engines/mesh.py runs tensor parallelism (with sequence and loss parallelism), FSDP2 over the
data-parallel dimensions (HSDP with dp_replicate) and torch.distributed.pipelining stages on
zeroplan's reference Llama model, in zeroplan's own loop. What it does not run is refused here,
one line naming the field: context parallelism with pipelining, under --simulate or with eager
attention (it runs torch's ring attention over SDPA with the CPU kernel added: measure/cp_cpu.py),
expert parallelism beside other dimensions (ep alone runs in measure/engines/mesh_moe.py), the Hugging Face
Trainer, engines other than fsdp2, offload, losses other than standard, learned positions.
"""

from __future__ import annotations

from zeroplan.errors import MeasureError
from zeroplan.spec.model import TransformerSpec
from zeroplan.spec.training import TrainingSpec

MESH_RECIPES = ("torchtitan", "plain")  # zeroplan's loop; the Trainer owns its own and has no mesh


def is_adapted_hsdp(training: TrainingSpec) -> bool:
    """LoRA on HSDP alone: the FSDP2 engine runs it over a 2-D (dp_replicate, dp_shard) mesh with the Hugging Face
    model and PEFT (engines/fsdp2_engine.py), not measure/engines/mesh.py, whose reference model has no adapters."""
    mesh = training.mesh
    return training.lora is not None and mesh.dp_replicate > 1 and (mesh.tp, mesh.cp, mesh.pp, mesh.ep) == (1, 1, 1, 1)


def is_mesh_run(training: TrainingSpec) -> bool:
    """Whether measure/engines/mesh.py (or DeepSpeed's, or expert parallelism's runner) runs `training`: a mesh beyond
    data-parallel sharding (spec/mesh.py), adapted HSDP aside."""
    return not training.mesh.is_trivial and not is_adapted_hsdp(training)


def refuse_unmeasurable(model: TransformerSpec, training: TrainingSpec, simulate: bool = False) -> None:
    """Raise MeasureError for a mesh run that measure/engines/mesh.py cannot run (and for torch.compile and
    float8 where measure does not run them: issue 23, measure/compiled.py)."""
    _refuse_programs(training, simulate)
    if not is_mesh_run(training):
        return
    if training.engine.value == "deepspeed":  # AutoTP and Ulysses (measure/engines/deepspeed_mesh.py)
        from zeroplan.measure.engines.deepspeed_mesh import refuse_unmeasurable as refuse_deepspeed

        return refuse_deepspeed(model, training)
    mesh = training.mesh
    if simulate and mesh.pp > 1:
        # pipelining/schedules.py `_warmup_p2p` reads its shape vote with .item(): DataDependentOutputException
        raise MeasureError("mesh.pp: a pipeline does not run under --simulate (fake tensors); measure it on real ranks")
    if mesh.cp > 1:
        _refuse_context_parallel(training, simulate)
    if mesh.ep > 1 and (mesh.tp, mesh.cp, mesh.pp, mesh.dp_replicate) != (1, 1, 1, 1):
        raise MeasureError("mesh.ep: expert parallelism is measured alone with FSDP2 (measure/engines/mesh_moe.py); "
                           "set tp, cp, pp and dp_replicate to 1")
    if mesh.ep > 1 and simulate:
        raise MeasureError("mesh.ep: expert parallelism does not run under --simulate (its all-to-all splits are "
                           "read with .tolist()); measure it on real ranks")
    if training.recipe.value not in MESH_RECIPES:
        raise MeasureError(f"recipe: a mesh is measured in zeroplan's loop ({' or '.join(MESH_RECIPES)}), "
                           f"not {training.recipe.value}")
    if training.engine.value != "fsdp2":
        raise MeasureError(f"engine: a mesh is measured with fsdp2 (torchtitan's composition), not {training.engine.value}")
    if training.program.loss.value != "standard":
        raise MeasureError(f"loss: {training.program.loss.value} is not measured on a mesh; use --loss standard")
    if training.offload_optimizer.value != "none" or training.offload_params.value != "none":
        raise MeasureError("offload: offload is not measured on a mesh")
    if training.program.activation_offload.value != "none":
        raise MeasureError("activation_offload: activation offload is not measured on a mesh")
    if model.position_embedding != "rotary":
        raise MeasureError("model: a mesh is measured on Llama-family models (rotary positions, as torchtitan's plan)")
    if mesh.dp_replicate > 1 and mesh.dp_shard(training.gpus) == 1:
        raise MeasureError("mesh.dp_replicate: without data-parallel sharding torchtitan replicates with DDP "
                           "(parallelize.py apply_ddp), which is not measured on a mesh; leave dp_shard above 1")

def _refuse_programs(training: TrainingSpec, simulate: bool) -> None:
    if training.compile and (is_mesh_run(training) or simulate):
        # the mesh runners build their own stages (not the workload's blocks); fake tensors do not compile
        raise MeasureError("compile: torch.compile is measured without a mesh and on real ranks (measure/compiled.py); "
                           "drop --tp/--cp/--pp/--ep/--dp-replicate and --simulate, or --compile")
    if training.compile and training.device.value == "cpu" and training.gpus > 1:
        # a compiled run is counted from the allocator's records, which miss the frees on gloo's threads
        raise MeasureError("compile: a compiled run on CPU is measured on one rank (--nproc 1, engine torch --no-ddp): "
                           "the allocator's records it is counted from miss the frees on gloo's threads")
    if training.float8 is not None and training.float8.precompute_scale:
        raise MeasureError("float8.precompute_scale: measure does not call precompute_float8_dynamic_scale_for_fsdp "
                           "after the optimizer step; drop --float8-precompute-scale")


def _refuse_context_parallel(training: TrainingSpec, simulate: bool) -> None:
    """What measure/cp_cpu.py does not run: its ring is torch's SDPA one on real ranks, without pipeline stages."""
    if training.mesh.pp > 1:
        raise MeasureError("mesh.cp: context parallelism is not measured with pipeline stages; measure with pp 1")
    if simulate:
        raise MeasureError("mesh.cp: context parallelism is not measured under --simulate (fake tensors); "
                           "measure it on real ranks")
    if training.attention.value != "fused":
        raise MeasureError("attention: context parallelism rings the SDPA kernel (torch's ring attention); "
                           "use --attention fused")


MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The dimensions of the measured mesh, outermost first (torchtitan ParallelDims.build_mesh)."""


def rank_coordinates(training: TrainingSpec, rank: int) -> dict[str, int]:
    """Where `rank` sits on the measured mesh: `init_device_mesh` lays ranks out row-major,
    `arange(world).view(sizes)` (torch/distributed/device_mesh.py), so the innermost (tp) varies fastest."""
    mesh = training.mesh
    sizes = {"pp": mesh.pp, "dp_replicate": mesh.dp_replicate, "dp_shard": mesh.dp_shard(training.gpus),
             "cp": mesh.cp, "tp": mesh.tp}
    coordinates = {}
    for name in reversed(MESH_DIMS):
        rank, coordinates[name] = divmod(rank, sizes[name])
    return {name: coordinates[name] for name in MESH_DIMS}


def rank_kind(training: TrainingSpec, rank: int) -> str:
    """The measured rank's kind: its pipeline position ("first", "middle", "last"; "only" without
    pipelining), the one thing that makes ranks of a torchtitan mesh hold different bytes."""
    mesh = training.mesh
    if mesh.pp == 1:
        return "only"
    stage = rank_coordinates(training, rank)["pp"]
    return "first" if stage == 0 else "last" if stage == mesh.pp - 1 else "middle"

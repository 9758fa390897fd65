"""The mesh in the spec (issue 14): the degrees fill the world, the model divides as they cut it,
and each engine runs only the dimensions it has."""

from __future__ import annotations

import pytest

from zeroplan.errors import SpecError
from zeroplan.importers.catalog import resolve_model
from zeroplan.spec.mesh import MeshSpec, PPSchedule, check_mesh
from zeroplan.spec.training import TrainingSpec


def training(gpus: int = 8, engine: str = "fsdp2", zero_stage: int = 3, **mesh) -> TrainingSpec:
    recipe = "torchtitan" if engine == "fsdp2" else "hf-trainer"  # torchtitan runs every dimension (spec/mesh.py)
    return TrainingSpec(engine=engine, zero_stage=zero_stage, gpus=gpus, mesh=MeshSpec(**mesh), grad_accum=8,
                        seq_len=4096, recipe=recipe)


def test_default_mesh_is_all_ones_and_data_parallel_takes_every_gpu():
    mesh = TrainingSpec(gpus=16).mesh
    assert mesh.is_trivial and mesh.pp_schedule == PPSchedule.ONE_F_ONE_B
    assert mesh.dp_shard(16) == 16 and mesh.fsdp_degree(16) == 16


def test_dp_shard_is_what_the_other_dimensions_leave():
    # torchtitan parallel_dims.py: dp_shard = world // (dp_replicate * cp * tp * pp)
    mesh = training(gpus=64, tp=4, cp=2, pp=2, dp_replicate=2).mesh
    assert mesh.dp_shard(64) == 2
    assert mesh.fsdp_degree(64) == 4  # FSDP shards over dp_shard * cp


def test_expert_parallelism_borrows_from_dp_shard_cp_and_tp():
    # parallel_dims.py build_mesh: efsdp = dp_shard * cp * tp // ep
    mesh = training(gpus=16, tp=2, ep=8).mesh
    assert mesh.expert_fsdp_degree(16) == 8 * 2 // 8


@pytest.mark.parametrize("mesh, message", [
    (dict(tp=3), r"mesh: tp 3 x cp 1 x pp 1 x dp_replicate 1 = 3 does not divide gpus 8"),
    (dict(tp=2, ep=16), r"mesh.ep: 16 does not divide dp_shard x cp x tp = 8"),
    (dict(pp=2, pp_schedule="interleaved-1f1b"), r"mesh.pp_virtual_stages: schedule interleaved-1f1b runs 2 or more"),
    (dict(pp=2, pp_virtual_stages=2), r"mesh.pp_virtual_stages: schedule 1f1b runs one stage per rank"),
])
def test_world_rules(mesh, message):
    with pytest.raises(SpecError, match=message):
        TrainingSpec(recipe="torchtitan", gpus=8, engine="fsdp2", zero_stage=3).varied(mesh=MeshSpec(**mesh))


@pytest.mark.parametrize("engine, stage, mesh, message", [
    ("torch", 0, dict(tp=2), r"mesh.tp: engine torch is data-parallel only; engine fsdp2 runs every mesh dimension"),
    ("paper", 3, dict(pp=2), r"mesh.pp: engine paper is data-parallel only"),
    ("deepspeed", 3, dict(tp=2), r"mesh.tp: DeepSpeed AutoTP training runs with ZeRO stages 0-2"),
    ("deepspeed", 2, dict(pp=2), r"mesh.pp: engine deepspeed does not run it .* engine fsdp2 \(torchtitan\) does"),
    ("deepspeed", 2, dict(dp_replicate=2), r"mesh.dp_replicate: engine deepspeed"),
])
def test_engine_rules(engine, stage, mesh, message):
    with pytest.raises(SpecError, match=message):
        TrainingSpec(gpus=8).varied(engine=engine, zero_stage=stage, mesh=MeshSpec(**mesh))


def test_engines_run_their_dimensions():
    TrainingSpec(gpus=8).varied(engine="deepspeed", zero_stage=2, mesh=MeshSpec(tp=2, cp=2))
    TrainingSpec(gpus=8, engine="fsdp2", zero_stage=3, recipe="torchtitan").varied(mesh=MeshSpec(tp=2, cp=2, pp=2))


@pytest.mark.parametrize("model, mesh, seq, message", [
    ("llama-3-8b", dict(tp=16), 4096, r"mesh.tp: 16 does not divide the model's num_kv_heads 8"),
    ("llama-3-8b", dict(cp=8), 4100, r"mesh.cp: load-balanced context parallelism cuts seq_len 4100 into 2 x cp = 16"),
    ("llama-3-8b", dict(tp=8), 4100, r"mesh.tp: sequence parallelism shards the 4100 tokens of each rank over tp 8"),
    ("gpt2", dict(pp=8, pp_schedule="interleaved-1f1b", pp_virtual_stages=2), 1024,
     r"mesh.pp: 12 layers cannot fill pp 8 x pp_virtual_stages 2 = 16 stages"),
    ("llama-3-8b", dict(ep=2), 4096, r"mesh.ep: the model has no experts"),
    ("mixtral-8x7b", dict(ep=16), 4096, r"mesh.ep: 16 does not divide the model's num_experts 8"),
])
def test_model_rules(model, mesh, seq, message):
    spec = TrainingSpec(recipe="torchtitan", gpus=16, engine="fsdp2", zero_stage=3, grad_accum=16, seq_len=seq, mesh=MeshSpec(**mesh))
    with pytest.raises(SpecError, match=message):
        check_mesh(resolve_model(model), spec)


def test_1f1b_needs_as_many_micro_batches_as_stages():
    spec = TrainingSpec(recipe="torchtitan", gpus=8, engine="fsdp2", zero_stage=3, grad_accum=2, mesh=MeshSpec(pp=4))
    with pytest.raises(SpecError, match=r"mesh.pp: schedule 1f1b needs at least pp 4 micro-batches; grad_accum is 2"):
        check_mesh(resolve_model("llama-3-8b"), spec)


def test_ulysses_splits_heads():
    spec = TrainingSpec(gpus=16, engine="deepspeed", zero_stage=2, mesh=MeshSpec(cp=16))
    with pytest.raises(SpecError, match=r"mesh.cp: Ulysses splits heads over cp x tp = 16, .* num_kv_heads 8"):
        check_mesh(resolve_model("llama-3-8b"), spec)


@pytest.mark.parametrize("dimension", ["tp", "cp", "pp"])
def test_lora_is_cut_by_hsdp_only(dimension):
    """LoRA composes with HSDP (FSDP2 over a 2-D mesh shards a PEFT model as any other: measured rows
    lora-*/mesh-dp_replicate2/...); under tp, cp or pp no measured program runs PEFT: one line naming it."""
    from zeroplan.importers.options import training_spec_from_options

    model = resolve_model("llama-3-8b")
    hsdp = training_spec_from_options({"gpus": 8, "engine": "fsdp2", "zero_stage": 3, "lora_rank": 16,
                                       "mesh_dp_replicate": 2}, None, model)
    check_mesh(model, hsdp)
    options = {"gpus": 8, "engine": "fsdp2", "zero_stage": 3, "lora_rank": 16, f"mesh_{dimension}": 2,
               "recipe": "torchtitan", "grad_accum": 4}
    spec = training_spec_from_options(options, None, model)
    with pytest.raises(SpecError, match=rf"^mesh.{dimension}: LoRA adapters and quantized bases are modelled with "
                                        r"dp_replicate \(HSDP\) only"):
        check_mesh(model, spec)


@pytest.mark.parametrize("recipe, mesh, message", [
    ("hf-trainer", dict(pp=2), r"^1 validation|mesh.pp: recipe hf-trainer does not run it \(it runs tp, cp, dp_replicate\)"),
    ("hf-trainer", dict(ep=2), r"mesh.ep: recipe hf-trainer does not run it"),
    ("torchtune", dict(cp=2), r"mesh.cp: recipe torchtune does not run it \(it runs tp, dp_replicate\)"),
])
def test_recipes_run_the_dimensions_their_programs_have(recipe, mesh, message):
    # accelerate 1.15.0 ParallelismConfig has dp_replicate, dp_shard, tp and cp sizes, no pipeline or
    # expert degree; torchtune's distributed recipes a tensor-parallel dim
    with pytest.raises(SpecError, match=message):
        TrainingSpec(gpus=8, engine="fsdp2", zero_stage=3, recipe=recipe, grad_accum=8).varied(mesh=MeshSpec(**mesh))
    TrainingSpec(gpus=8, engine="fsdp2", zero_stage=3, recipe=recipe).varied(mesh=MeshSpec(tp=2))

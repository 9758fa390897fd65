"""`zeroplan plan --mesh` searches expert parallelism and HSDP too (issue 14): the meshes it adds are valid
meshes of the world, rank by the mesh cost model (whose HSDP and EP terms follow their definitions), say
what they buy, and are written to a torchtitan TOML that reads back to the same mesh and estimate; a mesh
given without --mesh is planned as it is."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.estimate import estimate_mesh
from zeroplan.importers.catalog import resolve_model
from zeroplan.importers.gpus import get_gpu
from zeroplan.importers.mesh_options import torchtitan_mesh
from zeroplan.importers.options import training_spec_from_options
from zeroplan.importers.torchtitan_write import write_torchtitan_toml
from zeroplan.plan.cost import assumptions_for, model_flops
from zeroplan.plan.mesh import _meshes, plan_mesh
from zeroplan.plan.mesh_cost import mesh_step_cost
from zeroplan.spec.mesh import MeshSpec, check_mesh, routed_experts
from zeroplan.spec.training import TrainingSpec

H100 = get_gpu("h100-80gb")
BUDGET = int(H100.memory_bytes * 0.95)


@pytest.mark.parametrize("name, gpus", [("mixtral-8x7b", 64), ("qwen3-30b-a3b", 64), ("llama-3-8b", 32)])
def test_every_searched_mesh_is_a_valid_mesh_and_hsdp_and_ep_are_among_them(name, gpus):
    model = resolve_model(name)
    base = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=gpus, seq_len=4096, recipe="torchtitan")
    meshes = _meshes(model, base, {})
    for mesh in meshes:
        training = base.varied(mesh=mesh, zero_stage=2 if mesh.pp > 1 else 3, grad_accum=2 * mesh.pp)
        check_mesh(model, training)  # raises on a mesh the model cannot be cut by
        assert mesh.dp_shard(gpus) * mesh.model_ranks * mesh.dp_replicate == gpus
        if mesh.dp_replicate > 1:  # HSDP's shard group fills one node beside tp x cp
            assert mesh.tp * mesh.cp * mesh.dp_shard(gpus) == base.node_gpus and mesh.dp_shard(gpus) > 1
        if mesh.ep > 1:  # torchtitan: ep divides the experts and the dp_shard x cp x tp ranks it borrows
            assert routed_experts(model) % mesh.ep == 0 and (mesh.dp_shard(gpus) * mesh.cp * mesh.tp) % mesh.ep == 0
    assert any(mesh.dp_replicate > 1 for mesh in meshes)
    assert any(mesh.ep > 1 for mesh in meshes) == (routed_experts(model) > 1)


def _cost(model, training):
    facts = estimate_mesh(model, training)
    flops = model_flops(model, facts.ranks[0].estimate.model.params, facts.ranks[0].estimate.model.params)
    worst = facts.worst
    return mesh_step_cost(model, flops, worst.params, worst.kind.layers, training, assumptions_for(H100)), worst


def test_the_hsdp_all_reduce_is_a_ring_over_the_replicas_of_each_shard_between_nodes():
    # 2 (r - 1)/r of the rank's gradient shard, bf16, at the network's 50 GB/s, at each of the 4 micro-batches
    model = resolve_model("llama-3-8b")
    training = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=32, seq_len=4096, recipe="torchtitan", grad_accum=4,
                            mesh=MeshSpec(tp=2, dp_replicate=4))
    cost, worst = _cost(model, training)
    shard_bytes = worst.params / training.mesh.fsdp_degree(32) * 2
    assert cost.replicate_s == pytest.approx(4 * 2 * 3 / 4 * shard_bytes / 50e9)
    flat, _ = _cost(model, training.varied(mesh=MeshSpec(tp=2)))
    assert flat.replicate_s == 0
    # the shard group of 4 x tp 2 stays in a node: its gathers and reduce-scatters run on NVLink, not the network
    assert cost.data_parallel_s < flat.data_parallel_s


def test_expert_parallelism_gathers_each_ranks_share_of_the_experts_and_pays_an_all_to_all():
    model = resolve_model("mixtral-8x7b")
    base = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=64, seq_len=4096, recipe="torchtitan")
    costs = {ep: _cost(model, base.varied(mesh=MeshSpec(tp=2, ep=ep)))[0] for ep in (1, 2, 8)}
    assert costs[1].expert_parallel_s == 0 < costs[2].expert_parallel_s < costs[8].expert_parallel_s
    # the all-to-all: (ep - 1)/ep of the tokens' top-k copies leave a rank; 4 times a layer (dispatch, combine, x2)
    assert costs[8].expert_parallel_s / costs[2].expert_parallel_s == pytest.approx((7 / 8) / (1 / 2))
    # FSDP gathers and reduces 1/ep of each layer's experts instead of 1/tp: less data-parallel traffic as ep grows
    assert costs[8].data_parallel_s < costs[2].data_parallel_s == pytest.approx(costs[1].data_parallel_s)



def test_an_moe_spec_model_pays_its_all_to_all_and_gathers_only_its_share_of_the_experts():
    # Qwen3-MoE's experts live in its MoE spec (128 routed, top 8): the rank already holds E/ep experts
    # (estimate/parallel/experts.py), so no cost term may go below zero and data-parallel traffic falls with ep
    model = resolve_model("qwen3-30b-a3b")
    base = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=64, seq_len=4096, recipe="torchtitan")
    costs = {ep: _cost(model, base.varied(mesh=MeshSpec(ep=ep)))[0] for ep in (1, 8, 32)}
    assert all(value >= 0 for cost in costs.values() for value in cost.terms().values())
    assert costs[1].expert_parallel_s == 0 < costs[8].expert_parallel_s < costs[32].expert_parallel_s
    assert costs[32].data_parallel_s < costs[8].data_parallel_s < costs[1].data_parallel_s


@pytest.fixture(scope="module")
def mixtral_plan():
    base = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=64, seq_len=4096, recipe="torchtitan", loss="standard")
    return plan_mesh(resolve_model("mixtral-8x7b"), base, BUDGET, assumptions_for(H100), max_micro_batch=4, top=40,
                     given={"cp": 1, "pp": 4})


def test_meshes_with_ep_and_hsdp_rank_by_cost_and_say_what_they_buy(mixtral_plan):
    costs = [c.cost.gpu_seconds_per_token for c in mixtral_plan.top]
    assert costs == sorted(costs)
    assert all((c.training.mesh.cp, c.training.mesh.pp) == (1, 4) for c in mixtral_plan.top)  # given: fixed
    with_ep = [c for c in mixtral_plan.top if c.training.mesh.ep > 1]
    with_hsdp = [c for c in mixtral_plan.top if c.training.mesh.dp_replicate > 1]
    assert with_ep and with_hsdp
    assert all(f"ep {c.training.mesh.ep}: each rank gathers 1/{c.training.mesh.ep} of the experts" in c.reason
               for c in with_ep)
    assert all("HSDP: sharded over" in c.reason and "inside a node" in c.reason for c in with_hsdp)
    assert all("more GPU time per token than #1, most of it in" in c.reason for c in mixtral_plan.top[1:])


def test_an_hsdp_mesh_is_written_to_a_toml_that_reads_back_to_the_same_estimate(tmp_path):
    model = resolve_model("llama-3-8b")
    training = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=32, seq_len=4096, recipe="torchtitan", loss="standard",
                            micro_batch=2, mesh=MeshSpec(tp=2, dp_replicate=4))
    path = tmp_path / "job.toml"
    path.write_text(write_torchtitan_toml(training, model.name))
    back = training_spec_from_options({"gpus": 32}, str(path), model)
    assert back.mesh == training.mesh
    assert [r.estimate for r in estimate_mesh(model, back).ranks] == [r.estimate for r in estimate_mesh(model, training).ranks]


def test_an_expert_parallel_mesh_is_written_with_its_degree():
    # torchtitan has no Mixtral to name in [model]; its [parallelism] table reads back to the same mesh
    import tomllib

    training = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=64, seq_len=4096, recipe="torchtitan",
                            mesh=MeshSpec(tp=2, ep=8, dp_replicate=2))
    document = tomllib.loads(write_torchtitan_toml(training, "mixtral-8x7b"))
    assert MeshSpec(**torchtitan_mesh(document["parallelism"], 32, "job.toml")) == training.mesh


def test_a_mesh_given_without_mesh_search_is_planned_as_it_is(tmp_path):
    runner = CliRunner()
    common = ["plan", "llama-3-8b", "--gpu", "h100-80gb", "--gpus", "16", "--engine", "fsdp2", "--format", "json"]
    import json

    fixed = runner.invoke(cli, [*common, "--tp", "4"])
    assert fixed.exit_code == 0, fixed.output
    rows = json.loads(fixed.output)["top"]
    assert rows and all((row["mesh"]["tp"], row["mesh"]["cp"], row["mesh"]["pp"]) == (4, 1, 1) for row in rows)
    searched = runner.invoke(cli, [*common, "--tp", "4", "--mesh", "--recipe", "torchtitan"])
    assert searched.exit_code == 0, searched.output
    rows = json.loads(searched.output)["top"]
    assert all(row["mesh"]["tp"] == 4 for row in rows) and {row["mesh"]["pp"] for row in rows} != {1}


def test_a_given_degree_outside_the_searched_ones_is_planned_with_the_rest_searched():
    # HSDP of 4 replicas on 64 GPUs is not a shard group filling a node: given, it is searched all the same
    base = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=64, seq_len=4096, recipe="torchtitan", loss="standard")
    plan = plan_mesh(resolve_model("llama-3-8b"), base, BUDGET, assumptions_for(H100), max_micro_batch=2, top=3,
                     given={"dp_replicate": 4, "pp": 1})
    assert plan.top and all(c.training.mesh.dp_replicate == 4 for c in plan.top)


@pytest.mark.parametrize("args, message", [
    (["--gpus", "16-32", "--tp", "4"], "a mesh is planned on one GPU count: give --gpus N"),
    (["--gpus", "16", "--pp", "2", "--engine", "deepspeed"], "mesh.pp: engine deepspeed does not run it"),
    (["--gpus", "16", "--tp", "3"], "mesh: tp 3 x cp 1 x pp 1 x dp_replicate 1 = 3 does not divide gpus 16"),
    (["--gpus", "32", "--tp", "16", "--mesh"], "mesh.tp: 16 does not divide the model's num_kv_heads 8"),
])
def test_a_mesh_plan_refuses_in_one_line(args, message):
    engine = [] if "--engine" in args else ["--engine", "fsdp2"]
    result = CliRunner().invoke(cli, ["plan", "llama-3-8b", "--gpu", "h100-80gb", *engine, *args])
    assert result.exit_code == 2 and message in result.output and len(result.output.strip().splitlines()) == 1

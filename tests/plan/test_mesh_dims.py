"""`zeroplan plan --mesh` searches expert parallelism and HSDP too (issue 14): the meshes it adds are valid
meshes of the world, rank by the step-time model (whose HSDP and EP terms follow their definitions), say
what they buy, and are written to a torchtitan TOML that reads back to the same mesh and estimate; a mesh
given without --mesh is planned as it is."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.estimate import estimate_mesh
from zeroplan.estimate.parallel.mesh import rank_kinds
from zeroplan.estimate.pipeline import rank_params
from zeroplan.importers.catalog import resolve_model
from zeroplan.importers.gpus import get_gpu
from zeroplan.importers.mesh_options import torchtitan_mesh
from zeroplan.importers.options import training_spec_from_options
from zeroplan.importers.torchtitan_write import write_torchtitan_toml
from zeroplan.plan.meshes import meshes
from zeroplan.plan.rates import rates_for
from zeroplan.plan.search import Limits, SearchSpace, plan
from zeroplan.plan.step_time import step_time
from zeroplan.spec.mesh import MeshSpec, check_mesh, routed_experts
from zeroplan.spec.training import TrainingSpec

H100 = get_gpu("h100-80gb")
BUDGET = int(H100.memory_bytes * 0.95)


@pytest.mark.parametrize("name, gpus", [("mixtral-8x7b", 64), ("qwen3-30b-a3b", 64), ("llama-3-8b", 32)])
def test_every_searched_mesh_is_a_valid_mesh_and_hsdp_and_ep_are_among_them(name, gpus):
    model = resolve_model(name)
    base = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=gpus, seq_len=4096, recipe="torchtitan")
    found = meshes(model, base, gpus, {})
    for mesh in found:
        training = base.varied(mesh=mesh, zero_stage=2 if mesh.pp > 1 else 3, grad_accum=2 * mesh.pp)
        check_mesh(model, training)  # raises on a mesh the model cannot be cut by
        assert mesh.dp_shard(gpus) * mesh.model_ranks * mesh.dp_replicate == gpus
        if mesh.dp_replicate > 1:  # HSDP's shard group fills one node beside tp x cp
            assert mesh.tp * mesh.cp * mesh.dp_shard(gpus) == base.node_gpus and mesh.dp_shard(gpus) > 1
        if mesh.ep > 1:  # torchtitan: ep divides the experts and the dp_shard x cp x tp ranks it borrows
            assert routed_experts(model) % mesh.ep == 0 and (mesh.dp_shard(gpus) * mesh.cp * mesh.tp) % mesh.ep == 0
    assert any(mesh.dp_replicate > 1 for mesh in found)
    assert any(mesh.ep > 1 for mesh in found) == (routed_experts(model) > 1)


def _cost(model, training):
    return step_time(model, training, rates_for(H100)).terms


def test_hsdp_keeps_the_shard_groups_collectives_on_the_node_and_pays_an_all_reduce_between_nodes():
    model = resolve_model("llama-3-8b")
    training = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=32, seq_len=4096, recipe="torchtitan", grad_accum=4,
                            mesh=MeshSpec(tp=2, dp_replicate=4))
    hsdp, flat = _cost(model, training), _cost(model, training.varied(mesh=MeshSpec(tp=2)))
    assert flat["hsdp all-reduce"] == 0 < hsdp["hsdp all-reduce"]  # its volume: tests/plan/test_step_time.py
    # the shard group of 4 x tp 2 stays in a node: its gathers and reduce-scatters run on NVLink, not the network
    assert hsdp["data parallel"] < flat["data parallel"]


def test_expert_parallelism_gathers_each_ranks_share_of_the_experts_and_pays_an_all_to_all():
    model = resolve_model("mixtral-8x7b")
    base = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=64, seq_len=4096, recipe="torchtitan", micro_batch=2)
    costs = {ep: _cost(model, base.varied(mesh=MeshSpec(tp=2, ep=ep))) for ep in (1, 2, 8)}
    assert costs[1]["ep"] == 0 < costs[2]["ep"] < costs[8]["ep"]
    # the all-to-all: (ep - 1)/ep of the tokens' top-k copies leave a rank; 4 times a layer (dispatch, combine, x2)
    assert costs[8]["ep"] / costs[2]["ep"] == pytest.approx((7 / 8) / (1 / 2), rel=0.01)



def test_an_moe_spec_model_pays_its_all_to_all_and_gathers_only_its_share_of_the_experts():
    # Qwen3-MoE's experts live in its MoE spec (128 routed, top 8): the rank already holds E/ep experts
    # (estimate/parallel/experts.py), so no cost term may go below zero and data-parallel traffic falls with ep
    model = resolve_model("qwen3-30b-a3b")
    base = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=64, seq_len=4096, recipe="torchtitan")
    costs = {ep: _cost(model, base.varied(mesh=MeshSpec(ep=ep))) for ep in (1, 8, 32)}
    assert all(value >= 0 for cost in costs.values() for value in cost.values())
    assert costs[1]["ep"] == 0 < costs[8]["ep"] < costs[32]["ep"]
    helds = {ep: rank_params(model, base.varied(mesh=MeshSpec(ep=ep)), kind)
             for ep in (1, 8, 32) for kind in rank_kinds(model, MeshSpec(ep=ep), 1)}
    assert helds[32] < helds[8] < helds[1]  # what FSDP gathers and reduces falls with ep


def _mesh_plan(model, base, top, max_micro_batch, given):
    space = SearchSpace(gpu_counts=(base.gpus,), mesh="search", max_micro_batch=max_micro_batch, given=tuple(given.items()))
    return plan(model, base, space, Limits(BUDGET, headroom=0.0), rates_for(H100), top=top)


@pytest.fixture(scope="module")
def mixtral_plan():
    base = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=64, seq_len=4096, recipe="torchtitan", loss="standard")
    return _mesh_plan(resolve_model("mixtral-8x7b"), base, 40, 4, {"cp": 1, "pp": 4})


def test_meshes_with_ep_and_hsdp_rank_by_step_time_and_say_what_they_buy(mixtral_plan):
    costs = [c.step.gpu_seconds_per_token for c in mixtral_plan.top]
    assert costs == sorted(costs)
    assert all((c.training.mesh.cp, c.training.mesh.pp) == (1, 4) for c in mixtral_plan.top)  # given: fixed
    assert any(c.training.mesh.ep > 1 for c in mixtral_plan.top)
    assert any(c.training.mesh.dp_replicate > 1 for c in mixtral_plan.top)
    assert all(c.reason.startswith("+") or "same cost as #1" in c.reason for c in mixtral_plan.top[1:])
    for c in mixtral_plan.top:  # a term's reason names what it is
        if "mostly ep" in c.reason:
            assert f"ep {c.training.mesh.ep}: each MoE layer's all-to-all" in c.reason
        if "mostly hsdp all-reduce" in c.reason:
            assert f"across {c.training.mesh.dp_replicate} replicas" in c.reason


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
    searched = runner.invoke(cli, [*common, "--tp", "4", "--mesh", "--recipe", "torchtitan", "--top", "20"])
    assert searched.exit_code == 0, searched.output
    rows = json.loads(searched.output)["top"]
    assert all(row["mesh"]["tp"] == 4 for row in rows)
    assert len({(row["mesh"]["cp"], row["mesh"]["pp"], row["mesh"]["dp_replicate"]) for row in rows}) > 1


def test_a_given_degree_outside_the_searched_ones_is_planned_with_the_rest_searched():
    # HSDP of 4 replicas on 64 GPUs is not a shard group filling a node: given, it is searched all the same
    base = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=64, seq_len=4096, recipe="torchtitan", loss="standard")
    result = _mesh_plan(resolve_model("llama-3-8b"), base, 3, 2, {"dp_replicate": 4, "pp": 1})
    assert result.top and all(c.training.mesh.dp_replicate == 4 for c in result.top)


@pytest.mark.parametrize("args, message", [
    (["--gpus", "16", "--pp", "2", "--engine", "deepspeed"], "mesh.pp: engine deepspeed does not run it"),
    (["--gpus", "16", "--tp", "3"], "mesh: tp 3 x cp 1 x pp 1 x dp_replicate 1 = 3 does not divide gpus 16"),
    (["--gpus", "32", "--tp", "16", "--mesh"], "mesh.tp: 16 does not divide the model's num_kv_heads 8"),
])
def test_a_mesh_plan_refuses_in_one_line(args, message):
    engine = [] if "--engine" in args else ["--engine", "fsdp2"]
    result = CliRunner().invoke(cli, ["plan", "llama-3-8b", "--gpu", "h100-80gb", *engine, *args])
    assert result.exit_code == 2 and message in result.output and len(result.output.strip().splitlines()) == 1

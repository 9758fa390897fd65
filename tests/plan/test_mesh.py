"""`zeroplan plan --mesh` (issue 14, one planner with `plan`: issue 20): every configuration shown fits by its
full per-rank estimate and ranks by the step-time model, a configuration costs the same in `estimate`, `plan` and
`plan --mesh`, the search skips a mesh the world refuses instead of aborting, searches every ZeRO stage, and the
emitted torchtitan TOML reads back to the same estimate."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.estimate import estimate_mesh
from zeroplan.importers.catalog import resolve_model
from zeroplan.importers.gpus import get_gpu
from zeroplan.importers.options import training_spec_from_options
from zeroplan.importers.torchtitan_write import write_torchtitan_toml
from zeroplan.plan.policies import Policy
from zeroplan.plan.rates import rates_for
from zeroplan.plan.search import Limits, Planner, SearchSpace, plan
from zeroplan.spec.training import Checkpointing, TrainingSpec

H100 = get_gpu("h100-80gb")
BUDGET = int(H100.memory_bytes * 0.95)
GPT3_175B = "tests/data/throughput/models/gpt3-175b.toml"


def mesh_plan(model, base, top=5, max_micro_batch=4, **space):
    return plan(model, base, SearchSpace(gpu_counts=(base.gpus,), mesh="search", max_micro_batch=max_micro_batch, **space),
                Limits(BUDGET, headroom=0.0), rates_for(H100), top=top)


@pytest.fixture(scope="module")
def plan8b():
    base = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=16, seq_len=4096, recipe="torchtitan", loss="standard")
    return mesh_plan(resolve_model("llama-3-8b"), base)


def test_every_configuration_shown_fits_by_its_full_estimate_and_they_rank_by_step_time(plan8b):
    model = resolve_model("llama-3-8b")
    assert plan8b.top and plan8b.fitting <= plan8b.evaluated
    for config in plan8b.top:
        assert estimate_mesh(model, config.training) == config.estimate
        assert config.worst.peak_bytes <= BUDGET
    costs = [c.step.gpu_seconds_per_token for c in plan8b.top]
    assert costs == sorted(costs) and plan8b.top[0].reason.startswith("cheapest")
    assert any(not c.choice.mesh.is_trivial for c in plan8b.top)


def test_the_emitted_torchtitan_toml_reads_back_to_the_same_estimate(plan8b, tmp_path):
    model = resolve_model("llama-3-8b")
    for config in plan8b.top:
        path = tmp_path / "job.toml"
        path.write_text(write_torchtitan_toml(config.training, model.name))
        back = training_spec_from_options({"gpus": config.training.gpus}, str(path), model)
        assert back.mesh == config.training.mesh
        assert [r.estimate for r in estimate_mesh(model, back).ranks] == [r.estimate for r in config.estimate.ranks]


def _run(*args) -> dict:
    result = CliRunner().invoke(cli, [*args, "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_plan_and_plan_mesh_price_every_configuration_they_share_identically():
    # issue 20: llama-3-8b on 128 H100s with FSDP2, with and without --mesh
    common = ("plan", "llama-3-8b", "--gpu", "h100-80gb", "--gpus", "128", "--engine", "fsdp2", "--top", "40")
    flat, meshed = _run(*common), _run(*common, "--mesh")
    assert sorted(flat) == sorted(meshed)  # one JSON shape

    def priced(data):
        return {(c["config"], json.dumps(c["mesh"]), c["micro_batch"], c["grad_accum"]): c["step"] for c in data["top"]}

    shared = priced(flat).keys() & priced(meshed).keys()
    assert shared and all(priced(flat)[key] == priced(meshed)[key] for key in shared)


def test_estimate_plan_and_plan_mesh_show_the_same_step_for_one_configuration():
    # issue 24: the estimate's `step`, and the same configuration in plan and plan --mesh (the search pinned to it)
    config = ("--gpus", "128", "--engine", "fsdp2", "--recipe", "torchtitan", "--seq-len", "8192")
    estimate = _run("estimate", "llama-3.1-8b", "--gpu", "h100-80gb", *config, "--zero", "3", "--micro-batch", "2",
                    "--checkpointing", "op")["step"]
    pinned = ("plan", "llama-3.1-8b", "--gpu", "h100-80gb", *config, "--zero", "3", "--checkpointing", "op",
              "--offload", "none", "--micro-batches", "all", "--max-micro-batch", "2", "--top", "5")
    flat = _run(*pinned)["top"]
    meshed = _run(*pinned, "--mesh", "--tp", "1", "--cp", "1", "--pp", "1", "--dp-replicate", "1")["top"]
    for rows in (flat, meshed):
        row = next(row for row in rows if row["micro_batch"] == 2 and row["mesh"] is None)
        assert row["step"] == estimate


@pytest.mark.parametrize("gpus", [24, 384, 560, 2240])
def test_a_gpu_count_some_meshes_do_not_divide_is_searched_not_refused(gpus):
    # 24 GPUs with tp 2: fsdp 12 ranks, not a multiple of a node's 8 GPUs; the mesh search skips what it must
    model = resolve_model("llama-3.1-8b")
    base = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=gpus, seq_len=4096, recipe="torchtitan")
    result = mesh_plan(model, base, top=3, max_micro_batch=2)
    assert result.top and all(config.choice.gpus == gpus for config in result.top)


def test_deepspeed_meshes_search_every_zero_stage_and_a_175b_model_finds_a_plan_on_384_a100s():
    # without --zero DeepSpeed's mesh search tried only ZeRO-2, where nothing of a 175B model fits 384 A100s
    result = CliRunner().invoke(cli, ["plan", GPT3_175B, "--gpu", "a100-80gb", "--gpus", "384", "--mesh", "--format",
                                      "json", "--max-micro-batch", "8"])
    assert result.exit_code == 0, result.output
    top = json.loads(result.stdout)["top"]
    assert top and top[0]["zero_stage"] == 3 and top[0]["per_gpu"]["peak"] <= int(get_gpu("a100-80gb").memory_bytes * 0.95)


def test_a_fixed_global_batch_is_searched_exactly_on_a_mesh():
    """With a fixed global batch the accumulation falls as the micro-batch grows; with gradient sync on the last
    micro-batch only (FSDP2 set_requires_gradient_sync(False)) the unsharded gradients kept between micro-batches
    go with it, so memory need not grow with the micro-batch: every verdict equals a full estimate's, and a larger
    micro-batch fits where the smallest does not."""
    model = resolve_model("llama-3-8b")
    base = TrainingSpec(engine="fsdp2", zero_stage=2, gpus=16, seq_len=4096, recipe="torchtitan", grad_sync="last")
    space = SearchSpace(gpu_counts=(16,), mesh="search", given=(("tp", 2), ("cp", 1), ("pp", 1), ("dp_replicate", 1)),
                        max_micro_batch=8, global_batch=64, checkpointing=(Policy(Checkpointing.FULL),), zero_stages=(2,))
    limits = Limits(28 * 2**30, headroom=0.0)
    planner = Planner(model, base, rates_for(H100))
    evaluated, fitting, _, _ = planner.search(space, limits)
    found = {(hit.choice, hit.micro_batch) for hit in fitting}
    brute, total = set(), 0
    for choice in planner.choices(space, limits)[0]:
        for micro, accum in planner.micro_batches(space, 16, choice.mesh):
            total += 1
            training = planner.training(choice, micro, accum)
            if estimate_mesh(model, training).worst.estimate.peak_bytes <= limits.budget_bytes:
                brute.add((choice, micro))
    assert evaluated == total and found == brute
    assert {micro for _, micro in found} == {8}  # micro-batches 1-4 accumulate and do not fit; 8 does


def test_emit_torchtitan_needs_a_mesh_plan(tmp_path):
    result = CliRunner().invoke(cli, ["plan", "llama-3-8b", "--gpu", "h100-80gb", "--gpus", "16", "--engine", "fsdp2",
                                      "--emit", "torchtitan", str(tmp_path / "a.toml")])
    assert result.exit_code == 2 and "--emit torchtitan writes a torchtitan job of a mesh plan: add --mesh" in result.output


@pytest.mark.parametrize("emit", ["torchtitan", "deepspeed"])
def test_a_mesh_plan_with_the_default_engine_writes_what_it_is_asked_for(emit, tmp_path):
    # the engine follows the emitter when none is given: no loop between "use --emit torchtitan" and "recipe
    # torchtitan runs FSDP2"
    path = tmp_path / ("plan.toml" if emit == "torchtitan" else "ds.json")
    result = CliRunner().invoke(cli, ["plan", "llama-3-8b", "--gpu", "h100-80gb", "--gpus", "16", "--seq-len", "4096",
                                      "--mesh", "--top", "1", "--max-micro-batch", "4", "--emit", emit, str(path)])
    assert result.exit_code == 0, result.output
    assert f"wrote {path} ({emit}, plan #1)" in result.output and path.exists()

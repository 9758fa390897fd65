"""`zeroplan plan --mesh` (issue 14): every mesh shown fits by its full per-rank estimate, ranks by the mesh
cost model, whose pipeline bubble and compute follow their definitions, and the emitted torchtitan TOML
reads back to the same estimate."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.estimate import estimate_mesh
from zeroplan.importers.catalog import resolve_model
from zeroplan.importers.gpus import get_gpu
from zeroplan.importers.options import training_spec_from_options
from zeroplan.importers.torchtitan_write import write_torchtitan_toml
from zeroplan.plan.cost import assumptions_for, model_flops
from zeroplan.plan.mesh import plan_mesh
from zeroplan.plan.mesh_cost import mesh_step_cost
from zeroplan.spec.mesh import MeshSpec
from zeroplan.spec.training import TrainingSpec

H100 = get_gpu("h100-80gb")
BUDGET = int(H100.memory_bytes * 0.95)


@pytest.fixture(scope="module")
def plan8b():
    base = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=16, seq_len=4096, recipe="torchtitan", loss="standard")
    return plan_mesh(resolve_model("llama-3-8b"), base, BUDGET, assumptions_for(H100), max_micro_batch=4, top=5)


def test_every_mesh_shown_fits_by_its_full_estimate_and_they_rank_by_cost(plan8b):
    model = resolve_model("llama-3-8b")
    assert plan8b.top and plan8b.fitting <= plan8b.evaluated
    for candidate in plan8b.top:
        assert estimate_mesh(model, candidate.training).worst.estimate.peak_bytes == \
            candidate.estimate.worst.estimate.peak_bytes <= BUDGET
    costs = [c.cost.gpu_seconds_per_token for c in plan8b.top]
    assert costs == sorted(costs) and plan8b.top[0].reason.startswith("cheapest per token")


def test_the_emitted_torchtitan_toml_reads_back_to_the_same_estimate(plan8b, tmp_path):
    model = resolve_model("llama-3-8b")
    for candidate in plan8b.top:
        path = tmp_path / "job.toml"
        path.write_text(write_torchtitan_toml(candidate.training, model.name))
        back = training_spec_from_options({"gpus": candidate.training.gpus}, str(path), model)
        assert back.mesh == candidate.training.mesh
        assert [r.estimate for r in estimate_mesh(model, back).ranks] == [r.estimate for r in candidate.estimate.ranks]


def _cost(mesh: MeshSpec, accum: int):
    model = resolve_model("llama-3-8b")
    training = TrainingSpec(recipe="torchtitan", engine="fsdp2", zero_stage=2, gpus=64, seq_len=4096, grad_accum=accum, mesh=mesh)
    flops = model_flops(model, 8_030_261_248, 8_030_261_248)
    worst = estimate_mesh(model, training).worst
    return mesh_step_cost(model, flops, worst.params, worst.kind.layers, training, assumptions_for(H100))


def test_pipeline_bubble_is_p_minus_1_over_m_and_interleaving_divides_it():
    # Narayanan et al. 2021 section 2.2: (p - 1) / m of the ideal time; interleaved with v stages: (p - 1) / (v m)
    one = _cost(MeshSpec(pp=4), accum=8)
    assert one.pipeline_bubble_s == pytest.approx((one.compute_s + one.recompute_s) * 3 / 8)
    looped = _cost(MeshSpec(pp=4, pp_schedule="interleaved-1f1b", pp_virtual_stages=2), accum=8)
    assert looped.pipeline_bubble_s == pytest.approx((looped.compute_s + looped.recompute_s) * 3 / 16)


def test_a_gpu_computes_its_share_of_the_tokens_at_the_data_parallel_rate():
    # tp x cp x pp GPUs share each data-parallel rank's tokens: compute time per GPU-token is the same
    plain, meshed = _cost(MeshSpec(), accum=8), _cost(MeshSpec(tp=2, cp=2, pp=2), accum=8)
    ratio = (plain.compute_s / plain.tokens) / (meshed.compute_s / meshed.tokens)
    # but the efficiency term (cost.py: max x t / (t + 1024)) sees a local micro-batch of seq / cp tokens
    assert ratio == pytest.approx(((4096 + 1024) / 4096) / ((2048 + 1024) / 2048))
    assert meshed.tensor_parallel_s > 0 and meshed.context_parallel_s > 0 and plain.tensor_parallel_s == 0


def test_emit_torchtitan_needs_the_mesh_search(tmp_path):
    result = CliRunner().invoke(cli, ["plan", "llama-3-8b", "--gpu", "h100-80gb", "--gpus", "16", "--engine", "fsdp2",
                                      "--emit", "torchtitan", str(tmp_path / "a.toml")])
    assert result.exit_code == 2 and "--emit torchtitan writes a mesh plan: add --mesh" in result.output


def test_plan_mesh_emits_a_torchtitan_toml_that_estimate_reads_back(tmp_path):
    path = tmp_path / "plan.toml"
    result = CliRunner().invoke(cli, ["plan", "llama-3-8b", "--gpu", "h100-80gb", "--gpus", "16", "--engine", "fsdp2",
                                      "--seq-len", "4096", "--mesh", "--top", "1", "--max-micro-batch", "4",
                                      "--emit", "torchtitan", str(path)])
    assert result.exit_code == 0, result.output
    assert "it reads back to the same estimate" in result.output + (result.stderr or "")
    estimate = CliRunner().invoke(cli, ["estimate", "--config", str(path), "--gpus", "16", "--format", "json"])
    assert estimate.exit_code == 0, estimate.output

"""What measure runs on a mesh, refused before any worker starts, and where each rank sits (no torch)."""

from __future__ import annotations

import pytest

from zeroplan.errors import MeasureError
from zeroplan.importers.catalog import resolve_model
from zeroplan.measure.mesh_rules import rank_coordinates, rank_kind, refuse_unmeasurable
from zeroplan.spec.training import TrainingSpec


def _training(gpus: int, **mesh) -> TrainingSpec:
    return TrainingSpec(engine="fsdp2", zero_stage=3, gpus=gpus, device="cpu", recipe="torchtitan", loss="standard",
                        grad_accum=4, seq_len=64, mesh=mesh)


def test_context_parallelism_is_measured_on_real_ranks_with_sdpa():
    refuse_unmeasurable(resolve_model("tiny-llama"), _training(2, cp=2))
    refuse_unmeasurable(resolve_model("tiny-llama"), _training(4, cp=2, tp=2))


@pytest.mark.parametrize("mesh, simulate, attention, message", [
    (dict(cp=2, pp=2), False, "fused", "mesh.cp: context parallelism is not measured with pipeline stages"),
    (dict(cp=2), True, "fused", "mesh.cp: context parallelism is not measured under --simulate"),
    (dict(cp=2), False, "eager", "attention: context parallelism rings the SDPA kernel"),
])
def test_what_context_parallelism_does_not_run_is_refused_naming_the_field(mesh, simulate, attention, message):
    training = _training(4, **mesh).varied(attention=attention)
    with pytest.raises(MeasureError, match=message):
        refuse_unmeasurable(resolve_model("tiny-llama"), training, simulate=simulate)


def test_a_simulated_pipeline_is_refused():
    with pytest.raises(MeasureError, match="mesh.pp: a pipeline does not run under --simulate"):
        refuse_unmeasurable(resolve_model("tiny-llama"), _training(2, pp=2), simulate=True)


def test_the_trainer_recipe_is_refused_on_a_mesh():
    training = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=2, device="cpu", recipe="hf-trainer", mesh={"tp": 2})
    with pytest.raises(MeasureError, match="recipe: a mesh is measured in zeroplan's loop"):
        refuse_unmeasurable(resolve_model("tiny-llama"), training)


def test_a_plain_run_is_not_a_mesh_run():
    refuse_unmeasurable(resolve_model("tiny-gpt2"), TrainingSpec(engine="deepspeed", zero_stage=3, gpus=2))


def test_ranks_are_laid_out_row_major_with_tp_innermost():
    # init_device_mesh: mesh = arange(world).view(pp, dp_replicate, dp_shard, cp, tp)
    training = _training(8, tp=2, pp=2)  # dp_shard = 8 / (2 x 2) = 2
    assert rank_coordinates(training, 0) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0}
    assert rank_coordinates(training, 1) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1}
    assert rank_coordinates(training, 2) == {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 0}
    assert rank_coordinates(training, 7) == {"pp": 1, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 1}
    assert [rank_kind(training, r) for r in range(8)] == ["first"] * 4 + ["last"] * 4
    assert rank_kind(_training(4, tp=2), 3) == "only"
